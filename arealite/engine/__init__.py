"""Training engines: the FSDP2 trainer family (LM, PPO actor and critic, reward model) and its
packing, attention and optimizer pieces. Imports arealite.api and arealite.utils only; the
remote inference clients live in arealite.inference."""
