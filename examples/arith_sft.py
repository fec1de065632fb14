"""SFT warm start on synthetic arithmetic: `gsm8k_sft.py`'s loop with `train_dataset.path=arith`
(see examples/configs/arith_sft.yaml)."""

import logging
import sys

from gsm8k_sft import main

if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    main(sys.argv[1:])
