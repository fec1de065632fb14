"""Contracts: TrainEngine / InferenceEngine / RolloutWorkflow, wire and IO types, config dataclasses
and their loader. Imports arealite.utils only; every other package depends on this one."""
