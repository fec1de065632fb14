"""Algorithm presets: named sets of actor (and rollout) field values (`actor.preset=dapo`).

The loader merges a preset *under* the user's YAML and overrides, so explicit keys still win.
Kept apart from the dataclasses so that both `cli_args` (the `preset` field's allowed names) and
`config_loader` (which applies them) import it without importing each other.
"""

from __future__ import annotations

from typing import Any, Literal

PresetName = Literal["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "ppo"]

# Field values of PPOActorConfig, by preset name.
ACTOR_PRESETS: dict[PresetName, dict[str, Any]] = {
    "grpo": dict(group_reward_mean_level="group", group_reward_std_level="group"),
    "dr_grpo": dict(group_reward_mean_level="group", group_reward_std_level="none"),
    "dapo": dict(
        group_reward_mean_level="group",
        group_reward_std_level="group",
        eps_clip=0.2,
        eps_clip_higher=0.28,
        overlong_reward_penalty=True,
        overlong_tokens=64,
        overlong_penalty_factor=1.0,
    ),
    "rloo": dict(
        group_reward_mean_level="group", group_reward_std_level="none", leave_one_out=True
    ),
    "reinforce_pp": dict(
        group_reward_mean_level="none",
        group_reward_std_level="none",
        adv_norm_mean_level="batch",
        adv_norm_std_level="batch",
    ),
    "gspo": dict(
        group_reward_mean_level="group",
        group_reward_std_level="group",
        importance_sampling_level="sequence",
        eps_clip=3e-4,
        eps_clip_higher=4e-4,
    ),
    "ppo": dict(
        group_reward_mean_level="none",
        group_reward_std_level="none",
        adv_norm_mean_level="batch",
        adv_norm_std_level="batch",
        gae_lambda=0.95,
    ),
}

# Field values of the rollout section (RolloutConfig), by preset name: DAPO's dynamic
# sampling is the executor's filter.
ROLLOUT_PRESETS: dict[PresetName, dict[str, Any]] = {"dapo": dict(dynamic_sampling=True)}
