"""Launchers (local, Ray, Slurm): start the inference servers, then the torchrun trainer ranks.
Imports arealite.api and arealite.utils; runs the training script as a program, never imports it."""
