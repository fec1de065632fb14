"""SFT on CLEVR-count (vision): `gsm8k_sft.py`'s loop; rows carry their images
(pixel_values, image_grid_thw) to the trainer, which packs them with per-sequence M-RoPE.

    python -m arealite.launcher.local examples/clevr_count_70k_sft.py \
        --config examples/configs/clevr_count_70k_sft.yaml experiment_name=clevr-sft trial_name=run1
"""

import logging
import sys

from gsm8k_sft import main

from arealite.utils.vision import load_vlm_processor

if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    main(sys.argv[1:], load_processor=load_vlm_processor)
