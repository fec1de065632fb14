"""Leaf helpers every layer uses: data packing, distributed, FSDP, checkpoint files, stats, RL math.
Imports no other arealite package (so anything may import it)."""
