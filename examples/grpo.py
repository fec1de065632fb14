"""GRPO for any task: asynchronous rollouts, decoupled PPO, FSDP2. The task is the config's
`train_dataset` / `valid_dataset` (a built-in task or your own file) and `reward:` (a built-in
name or your own function); see README "Bring your own task".

    python -m arealite.launcher.local examples/grpo.py --config examples/configs/gsm8k_grpo.yaml \
        experiment_name=gsm8k trial_name=run1 actor.path=Qwen/Qwen2.5-1.5B-Instruct

Rows with images (a vision task, or a model folder with an image processor) run
VisionRLVRWorkflow with the model's processor; `agent:` trains an agent program through an
AgentProxy. What each call does: arealite/recipes/grpo.py.
"""

from __future__ import annotations

import logging
import sys

from arealite.api.cli_args import GRPOConfig, load_expr_config
from arealite.lifecycle.fast_exit import run_then_exit_fast
from arealite.recipes.grpo import GRPOTrainer, record_rollouts
from arealite.recipes.grpo_run import GRPORun


def main(argv: list[str], workflow_cls=None, load_processor=None) -> None:
    """`workflow_cls(reward_fn, gconfig, processor or tokenizer, ..., reward_pool=...)` makes the
    episodes (default: RLVRWorkflow, VisionRLVRWorkflow for rows with images);
    `load_processor(path)` loads the processor the datasets and workflows use."""
    config = load_expr_config(argv, GRPOConfig)  # YAML + key=value overrides
    run = GRPORun.build(config, workflow_cls, load_processor)  # data, tokenizer, workflow
    if config.mode == "rollout_only":  # generate, score and record; no trainer
        return record_rollouts(run)
    # The actor (+ reference, critic), the servers or a recording, weight sync, services.
    trainer = GRPOTrainer(run)
    start = trainer.resume()  # the last recover checkpoint's step, else 0
    for global_step in range(start, trainer.total_steps):
        # 1. Rollout: async (staleness-bounded, overlaps training), sync (eta = 0) or recorded.
        batch = trainer.rollout(global_step)
        # 2. Reference logprobs, values, advantages, the PPO update.
        stats = trainer.train_step(batch, global_step)
        # 3. Weight sync: the servers load the new weights, tagged with the next version.
        trainer.publish_weights(global_step + 1)
        # 4. Services: HF export, held-out evaluation, metrics (TensorBoard + JSONL + PNG).
        trainer.save(global_step)
        stats.update(trainer.evaluate(global_step))
        trainer.log(global_step, stats)
        # Last: a checkpoint for step s+1 implies step s is logged (resuming never leaves a gap).
        trainer.recover.dump(global_step + 1)
        if trainer.is_last(global_step):  # total_train_secs can end the run early
            break
    trainer.finish()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    run_then_exit_fast(main, sys.argv[1:])  # a finished run skips ~1 s of interpreter teardown
