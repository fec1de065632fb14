"""Offline test fixtures: tiny random HF models (Qwen2 LM, Qwen2-VL) with trained tokenizers.
Imports arealite.utils only; imported by tests, benchmarks and demo scripts, never by the library."""
