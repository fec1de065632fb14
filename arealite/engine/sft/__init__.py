"""Supervised fine-tuning on an FSDP engine (LMEngine / FSDPLMEngine: train_lm, evaluate_lm).
Part of arealite.engine: imports arealite.engine, arealite.api and arealite.utils."""
