"""GRPO on CLEVR-count (vision): `gsm8k_grpo.py`'s loop with VisionRLVRWorkflow, the model's
processor and the counting reward. Images go to the inference server as base64 with the expanded
prompt ids, and ride along in the batch (`multi_modal_input`) to the trainer.

    python -m arealite.testing.tiny_vlm runs/demo/tiny_vlm      # CPU: a tiny random Qwen2-VL
    python -m arealite.launcher.local examples/clevr_count_70k_grpo.py \
        --config examples/configs/clevr_count_70k_grpo.yaml experiment_name=clevr trial_name=run1

On GPUs: actor.path=Qwen/Qwen2-VL-2B-Instruct train_dataset.path=BUAADreamer/clevr_count_70k
allocation_mode=sglang.d1p1t1+d1p1t1 (the synthetic_counting set is the offline stand-in).
"""

import logging
import sys

from gsm8k_grpo import main

from arealite.reward.clevr_count import clevr_count_reward_fn
from arealite.utils.vision import load_vlm_processor
from arealite.workflow.vision_rlvr import VisionRLVRWorkflow

if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    main(
        sys.argv[1:],
        reward_fn=clevr_count_reward_fn,
        workflow_cls=VisionRLVRWorkflow,
        load_processor=load_vlm_processor,
    )
