"""StalenessController: the admission formula of docs/design.md, checked case by case."""

from __future__ import annotations

import pytest

from arealite.rollout import StalenessController


def capacity_by_formula(C, B, eta, W, v, running, accepted, oldest=None):
    """min(C/W - running, (eta + o + 1) * B/W - (accepted + running)), o = the oldest running
    episode's start version (v when none runs), as docs/design.md writes it."""
    c, b = max(1, C // W), max(1, B // W)
    o = v if oldest is None else min(v, oldest)
    return min(c - running, (eta + o + 1) * b - (accepted + running))


def test_synchronous_rl_admits_exactly_one_batch_per_version():
    s = StalenessController(
        max_concurrent_rollouts=64, consumer_batch_size=8, max_head_offpolicyness=0
    )
    assert s.capacity(version=0, running=0, accepted=0) == 8
    assert s.capacity(version=0, running=3, accepted=5) == 0  # the batch is spent
    assert s.capacity(version=1, running=0, accepted=8) == 8  # the next version, the next batch


def test_eta_lets_rollouts_run_eta_versions_ahead():
    s = StalenessController(
        max_concurrent_rollouts=100, consumer_batch_size=4, max_head_offpolicyness=2
    )
    assert s.capacity(version=0, running=0, accepted=0) == 12  # (2 + 0 + 1) * 4
    assert s.capacity(version=0, running=4, accepted=8) == 0
    assert s.capacity(version=3, running=4, accepted=8) == 12  # (2 + 3 + 1) * 4 - 12


def test_refusals_over_provision_and_surplus_past_the_bound_is_refused():
    """With a measured acceptance rate p, running episodes count at their expected yield; the
    bound itself is kept by within_bound at acceptance: the (k)-th accepted episode, started at
    version v, must be trained at most eta versions later (k <= (eta + v + 1) * B)."""
    s = StalenessController(
        max_concurrent_rollouts=100, consumer_batch_size=8, max_head_offpolicyness=0
    )
    assert s.capacity(version=0, running=0, accepted=0, accept_rate=0.5) == 16
    assert s.capacity(version=0, running=10, accepted=3, accept_rate=0.5) == 0  # 10 + 2 x 5
    assert s.capacity(version=0, running=0, accepted=0, accept_rate=0.01) == 32  # rate floor 1/4
    assert s.capacity(version=0, running=0, accepted=0, accept_rate=1.0) == 8  # as before
    assert [s.within_bound(0, a) for a in (0, 7, 8)] == [True, True, False]
    assert s.within_bound(1, 8) and not s.within_bound(1, 16)
    eta2 = StalenessController(
        max_concurrent_rollouts=100, consumer_batch_size=8, max_head_offpolicyness=2
    )
    assert eta2.within_bound(0, 23) and not eta2.within_bound(0, 24)


def test_the_budget_counts_from_the_oldest_running_episode():
    """Episodes finish out of order: one started at version 0 still runs at version 2 while
    later ones were trained. Counting from v would admit starts that push it past eta; counting
    from the oldest start keeps it within the bound, so it is never dropped as surplus."""
    s = StalenessController(
        max_concurrent_rollouts=100, consumer_batch_size=2, max_head_offpolicyness=1
    )
    # version 1: batch 0 trained, 3 accepted, the straggler from version 0 still runs
    assert s.capacity(version=1, running=1, accepted=3) == 2  # (1 + 1 + 1) * 2 - 4
    assert s.capacity(version=1, running=1, accepted=3, oldest_running=0) == 0  # 2 * 2 - 4
    # what it guards: by v, 5 more accepted first, and the straggler would be the 6th
    assert not s.within_bound(0, 5) and s.within_bound(0, 3)
    assert s.capacity(version=1, running=1, accepted=3, oldest_running=1) == 2  # as from v


def test_concurrency_caps_and_world_size_splits_the_budget():
    s = StalenessController(
        max_concurrent_rollouts=6, consumer_batch_size=100, max_head_offpolicyness=0
    )
    assert s.capacity(version=0, running=2, accepted=0) == 4
    two = StalenessController(6, 8, 1, world_size=2)  # per rank: C = 3, B = 4
    assert two.capacity(version=0, running=0, accepted=0) == 3
    assert two.capacity(version=0, running=1, accepted=6) == 1  # (1 + 0 + 1) * 4 - 7
    tiny = StalenessController(1, 1, 0, world_size=4)  # never rounds a rank's share to zero
    assert tiny.capacity(version=0, running=0, accepted=0) == 1


@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("eta", [0, 1, 4])
def test_matches_the_documented_formula(W, eta):
    s = StalenessController(10, 6, eta, world_size=W)
    for v in range(4):
        for running in range(0, 8, 3):
            for accepted in range(0, 30, 7):
                for oldest in (None, 0, v):
                    got = s.capacity(v, running, accepted, oldest_running=oldest)
                    want = capacity_by_formula(10, 6, eta, W, v, running, accepted, oldest)
                    assert got == want


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(max_concurrent_rollouts=0), "max_concurrent_rollouts"),
        (dict(consumer_batch_size=0), "consumer_batch_size"),
        (dict(max_head_offpolicyness=-1), "max_head_offpolicyness"),
        (dict(world_size=0), "world_size"),
    ],
)
def test_bad_settings_name_the_setting(kw, name):
    args = dict(max_concurrent_rollouts=4, consumer_batch_size=4, max_head_offpolicyness=0)
    with pytest.raises(ValueError, match=name):
        StalenessController(**{**args, **kw})


def test_unset_consumer_batch_size_is_named():
    with pytest.raises(ValueError, match="rollout.consumer_batch_size is unset"):
        StalenessController(4, None, 1)
