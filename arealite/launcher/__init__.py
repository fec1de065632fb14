"""Launchers (local, Ray, Slurm): start the inference servers, then the torchrun trainer ranks;
and service discovery (`name_resolve`: how a run's processes find each other on a cluster).
Imports arealite.api, arealite.utils, arealite.tasks and arealite.reward (preflight opens the data
and calls the rewards); runs the training script as a program, never imports it."""
