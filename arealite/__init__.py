"""arealite: asynchronous RL (GRPO/PPO, SFT) for LLMs; packages by layer, see DESIGN.md.
This file imports nothing: `import arealite` stays cheap (no torch)."""
