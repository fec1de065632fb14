"""Training engines: the FSDP2 trainer family (LM, PPO actor and critic, reward model) and its
packing, attention and optimizer pieces, its FSDP2 helpers (`fsdp`) and chunked log-probs
(`logprobs`). Imports arealite.api, arealite.utils and
arealite.checkpoint only; the remote inference clients live in arealite.inference."""
