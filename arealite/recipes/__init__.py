"""Recipes: whole training runs built from the config sections. `GRPOTrainer` (grpo.py) is the
library side of examples/grpo.py: the models, the batches' source (servers or a recording),
weight sync, evaluation and the training services, each step's pieces behind one method.

The top library layer: imports any arealite package but `launcher` and `testing`.
"""
