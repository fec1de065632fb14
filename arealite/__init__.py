"""arealite: asynchronous RL (GRPO/PPO, SFT) for LLMs; packages by layer, see docs/design.md.
This file imports nothing: `import arealite` stays cheap (no torch)."""
