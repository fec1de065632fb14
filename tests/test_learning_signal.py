"""NoLearningSignal: K consecutive steps whose every group has equal rewards warn once."""

from __future__ import annotations

import logging

import torch

from arealite.trainer.learning_signal import NoLearningSignal


def test_warns_once_after_k_signal_free_steps_with_numbers_and_causes(caplog):
    d = NoLearningSignal(steps=3, group_size=2)
    with caplog.at_level(logging.WARNING, logger="arealite.trainer"):
        assert d.observe(0, torch.zeros(4)) is None
        assert d.observe(1, [0.0, 1.0, 0.0, 0.0]) is None  # one informative group: reset
        assert d.observe(2, torch.zeros(4)) is None
        assert d.observe(3, torch.zeros(4)) is None
        message = d.observe(4, torch.zeros(4))
        assert d.observe(5, torch.zeros(4)) is None  # once
    assert "steps 2..4 (3 steps, 2 groups of 2" in message and "rewards seen: 0 x12" in message
    assert "gets None for a column" in message and "too hard" in message
    assert caplog.text.count("no learning signal") == 1


def test_all_correct_says_too_easy_and_mixed_groups_never_warn():
    d = NoLearningSignal(steps=2, group_size=3)
    d.observe(0, [1.0] * 6)
    assert "too easy" in d.observe(1, [1.0] * 6)
    d = NoLearningSignal(steps=2, group_size=2)
    assert all(d.observe(s, [0.0, 0.0, 1.0, 0.5]) is None for s in range(10))
    d = NoLearningSignal(steps=0, group_size=2)  # off
    assert all(d.observe(s, [0.0] * 4) is None for s in range(10))
