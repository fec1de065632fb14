"""Rollout workflows: one episode per data item (RLVR, multi-turn, vision RLVR) -> a TensorDict.
Imports arealite.api, arealite.utils and arealite.reward."""
