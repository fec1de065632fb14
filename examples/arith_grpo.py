"""GRPO on synthetic arithmetic (the CPU default): `gsm8k_grpo.py`'s loop with the exact-match
reward (see examples/configs/arith_grpo.yaml)."""

import logging
import sys

from gsm8k_grpo import main

from arealite.reward.arith import arith_reward_fn

if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    main(sys.argv[1:], reward_fn=arith_reward_fn)
