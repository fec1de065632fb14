"""tests/gpu: the checks that need a CUDA GPU (marker `gpu`); skipped with the reason where
there is none. Run them on a lent GPU machine: `pytest tests/gpu -m gpu` (README "The first
GPU run")."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "gpu")
    reason = "needs a CUDA GPU (torch.cuda.is_available() is False here)"
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=reason))
