"""PPO / GRPO on an FSDP engine: the actor (logprobs, advantages, ppo_update) and the critic.
Part of arealite.engine: imports arealite.engine, arealite.api and arealite.utils."""
