"""WorkflowExecutor on a RemoteSGLangEngine against a real server."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from arealite.api.cli_args import RolloutConfig
from arealite.api.io_struct import GenerationHyperparameters, ModelRequest
from arealite.api.workflow_api import RolloutError, RolloutWorkflow
from arealite.inference.sglang_remote import RemoteSGLangEngine
from arealite.rollout import WorkflowExecutor
from arealite.rollout.group_filter import InformativeGroupFilter
from arealite.server.process import launch_server
from arealite.utils.data import concat_padded_tensors, pad_sequences_to_tensors

pytestmark = pytest.mark.integration


class OneGeneration(RolloutWorkflow):
    """A short real generation; fails on items with 'boom', rejects items with 'reject'."""

    def __init__(self, max_new_tokens: int = 3, ignore_eos: bool = False):
        self.gconfig = GenerationHyperparameters(
            max_new_tokens=max_new_tokens, ignore_eos=ignore_eos
        )

    async def arun_episode(self, engine, data):
        if data.get("boom"):
            raise ValueError(f"bad item {data['id']}")
        resp = await engine.agenerate(
            ModelRequest(input_ids=[5, 6, 7, data["id"] % 100], gconfig=self.gconfig)
        )
        if data.get("reject"):
            return None
        seq = resp.input_tokens + resp.output_tokens
        return pad_sequences_to_tensors(
            [{"input_ids": torch.tensor(seq), "item": torch.tensor(data["id"])}]
        )


class ReturnsDict(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        return {"input_ids": [1]}


class Forever(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        await asyncio.sleep(3600)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = launch_server(tiny_model_dir, dtype="float32")
    yield s
    s.stop()


def make_executor(server, **kw) -> WorkflowExecutor:
    engine = RemoteSGLangEngine(RolloutConfig(**kw))
    engine.initialize([server.address])
    executor = WorkflowExecutor(engine.config, engine)
    executor.initialize()
    return executor


@pytest.fixture
def engine_factory(server):
    """Makes executors (each on its own engine); destroys both afterwards."""
    made = []

    def make(**kw):
        made.append(make_executor(server, **kw))
        return made[-1]

    yield make
    for ex in made:
        ex.destroy()
        ex.engine.destroy()


def rollout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "arealite-rollout"]


@pytest.mark.parametrize("eta", [0, 1])
def test_staleness_bound(engine_factory, eta):
    B = 2
    executor = engine_factory(
        consumer_batch_size=B, max_head_offpolicyness=eta, max_concurrent_rollouts=3 * B
    )
    wf = OneGeneration()
    for i in range(3 * B):
        executor.submit({"id": i}, wf)
    allowed = min(3 * B, (eta + 1) * B)
    assert executor.wait(allowed, timeout=120).batch_size[0] == allowed
    with pytest.raises(TimeoutError, match="only 0 accepted.*version=0"):
        executor.wait(1, timeout=1.5)
    s = executor.stats()
    assert (s["accepted"], s["running"], s["queued"]) == (allowed, 0, 3 * B - allowed)
    assert executor.get_capacity() == 0

    executor.set_version(1)  # one more batch may start
    more = min(3 * B, (eta + 2) * B) - allowed
    assert executor.wait(more, timeout=120).batch_size[0] == more
    s = executor.stats()
    assert (s["accepted"], s["queued"], s["submitted"]) == (
        allowed + more,
        3 * B - allowed - more,
        3 * B,
    )
    assert executor.get_capacity() <= 0 or s["queued"] == 0


class Sleeps(RolloutWorkflow):
    """An episode of `secs` seconds: long and short answers, without a server's timing."""

    async def arun_episode(self, engine, data):
        await asyncio.sleep(data["secs"])
        return pad_sequences_to_tensors(
            [{"input_ids": torch.tensor([1, 2]), "item": torch.tensor(data["id"])}]
        )


def test_a_long_episode_holds_admission_instead_of_being_dropped(engine_factory):
    """Out-of-order finishing (the long regime): item 0 runs for 3 s, the rest finish at once.
    The staleness budget counts from the oldest running episode, so nothing starts that could
    push item 0 past eta; it is trained in the next batch, and no episode is ever surplus."""
    B, eta = 2, 1
    executor = engine_factory(
        consumer_batch_size=B, max_head_offpolicyness=eta, max_concurrent_rollouts=100
    )
    wf = Sleeps()
    for i in range(8):
        executor.submit({"id": i, "secs": 3.0 if i == 0 else 0.0}, wf)
    first = executor.wait(B, timeout=30)["item"].tolist()  # batch 0: two of items 1-3
    executor.set_version(1)
    time.sleep(0.5)  # by v alone, 2 more could start now and finish before item 0
    s = executor.stats()
    assert (s["running"], s["accepted"]) == (1, 3), s  # only item 0 runs
    second = executor.wait(B, timeout=30)["item"].tolist()  # batch 1: the third short one, item 0
    assert 0 in second and 0 not in first
    executor.set_version(2)
    rest = executor.wait(4, timeout=30)["item"].tolist()
    assert sorted(first + second + rest) == list(range(8))
    assert executor.stats()["surplus"] == 0


def test_concurrency_limit_and_rejections_free_slots(engine_factory):
    executor = engine_factory(consumer_batch_size=4, max_concurrent_rollouts=2)
    wf = OneGeneration()
    peak = 0
    for i in range(8):  # rejections come first: they must not use up the staleness budget
        executor.submit({"id": i, "reject": i < 4}, wf)
    deadline = time.monotonic() + 120
    while executor.stats()["accepted"] + executor.stats()["rejected"] < 8:
        peak = max(peak, executor.stats()["running"])
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert peak <= 2
    # Rejected episodes free their staleness slot: 4 accepted at version 0 with B=4, eta=0.
    out = executor.wait(4, timeout=10)
    assert sorted(out["item"].tolist()) == [4, 5, 6, 7]
    s = executor.stats()
    assert (s["accepted"], s["rejected"], s["failed"]) == (4, 4, 0)


def test_should_accept_filters(engine_factory):
    executor = engine_factory(consumer_batch_size=8)
    data = [{"id": i} for i in range(6)]
    out = executor.rollout_batch(data, OneGeneration(), should_accept=lambda td: td["item"][0] < 3)
    assert out["item"].tolist() == [0, 1, 2]  # input order
    assert executor.stats()["rejected"] == 3


def test_workflow_exception_surfaces_with_its_data_item(engine_factory):
    executor = engine_factory(consumer_batch_size=4)
    wf = OneGeneration()
    bad = {"id": 7, "boom": True}
    executor.submit({"id": 1}, wf)
    executor.submit(bad, wf)
    with pytest.raises(RolloutError, match=r"OneGeneration.*'id': 7.*bad item 7") as info:
        executor.wait(2, timeout=120)
    assert info.value.data == bad
    assert isinstance(info.value.__cause__, ValueError)
    assert executor.wait(1, timeout=120)["item"].tolist() == [1]  # the executor keeps going
    assert executor.stats()["failed"] == 1
    with pytest.raises(RolloutError, match="'id': 3"):
        executor.rollout_batch([{"id": 2}, {"id": 3, "boom": True}], wf)
    with pytest.raises(RolloutError, match="must return a TensorDict or None, got dict"):
        executor.rollout_batch([{"id": 4}], ReturnsDict())


def test_rollout_batch_larger_than_queue(engine_factory):
    executor = engine_factory(consumer_batch_size=8, max_concurrent_rollouts=2, queue_size=2)
    out = executor.rollout_batch([{"id": i} for i in range(7)], OneGeneration())
    assert out["item"].tolist() == list(range(7))
    with pytest.raises(queue.Full, match="queue_size"):
        for _ in range(10):
            executor.submit({"id": 0}, Forever())


def test_prepare_batch_cycles_dataloader(engine_factory):
    executor = engine_factory(consumer_batch_size=2, max_head_offpolicyness=1)
    loader = DataLoader([{"id": i} for i in range(3)], batch_size=2, collate_fn=lambda x: x)
    wf = OneGeneration()
    seen = []
    for step in range(3):
        batch = executor.prepare_batch(loader, wf)
        assert batch.batch_size[0] == 2
        seen += batch["item"].tolist()
        executor.set_version(step + 1)
    assert set(seen) <= {0, 1, 2} and len(seen) == 6  # wrapped into a second epoch
    # eta=1: at most (eta + v + 1) * B episodes were ever started.
    s = executor.stats()
    assert s["accepted"] + s["running"] <= (1 + 3 + 1) * 2


class RewardedGroup(OneGeneration):
    """A real generation, then a group of two rows whose rewards differ only for odd ids."""

    async def arun_episode(self, engine, data):
        td = await super().arun_episode(engine, data)
        two = concat_padded_tensors([td, td.clone()])
        two["rewards"] = torch.tensor([0.0, float(data["id"] % 2)])
        return two


@pytest.mark.parametrize("max_oversample", [3.0, 1.0])
def test_equal_reward_groups_are_replaced_within_the_cap(engine_factory, max_oversample):
    """DAPO's dynamic sampling at the executor: even ids (equal rewards) never reach the batch
    and odd ones take their places; staleness counts accepted episodes only. With a cap of 1
    (no over-sampling) every group is accepted and counted as uninformative."""
    executor = engine_factory(consumer_batch_size=2, max_head_offpolicyness=0)
    loader = DataLoader([{"id": i} for i in range(40)], batch_size=2, collate_fn=lambda x: x)
    group_filter = InformativeGroupFilter(batch_size=2, max_oversample=max_oversample)
    items = []
    for step in range(3):
        batch = executor.prepare_batch(loader, RewardedGroup(), group_filter)
        assert batch.batch_size[0] == 4  # 2 groups x 2 rows: the batch is refilled, not shrunk
        items += batch["item"][::2].tolist()
        stats = group_filter.take_stats()
        executor.set_version(step + 1)
        assert stats["rollout/groups_dropped"] <= round((max_oversample - 1) * 2)
    if max_oversample > 1:
        assert all(i % 2 == 1 for i in items), items
        assert executor.stats()["rejected"] > 0
    else:
        assert any(i % 2 == 0 for i in items) and executor.stats()["rejected"] == 0
    assert executor.stats()["accepted"] - executor.stats()["ready"] == 6


class SolvedOrMixedGroup(RewardedGroup):
    """Even ids: both rows earn 1 (solved); odd ids: 1 and 0."""

    async def arun_episode(self, engine, data):
        two = await super().arun_episode(engine, data)
        two["rewards"] = torch.tensor([1.0, float(data["id"] % 2 == 0)])
        return two


def test_prompts_whose_groups_keep_being_solved_are_skipped_before_generation(engine_factory):
    """The filter as a GroupFilter: it sees each item, learns which prompts keep being solved
    (even ids here) and skips most of their later rows before they start. Skipped rows never
    reach the engine or the staleness counters, and need no replay on recovery."""
    executor = engine_factory(consumer_batch_size=2, max_head_offpolicyness=0)
    rows = [{"id": i, "messages": f"prompt {i % 4}"} for i in range(400)]  # 4 prompts, repeated
    loader = DataLoader(rows, batch_size=2, collate_fn=lambda x: x)
    group_filter = InformativeGroupFilter(batch_size=2, max_oversample=3.0, skip_max_prob=0.9)
    skipped = 0
    for step in range(20):
        batch = executor.prepare_batch(loader, SolvedOrMixedGroup(), group_filter)
        assert all(i % 2 == 1 for i in batch["item"][::2].tolist())
        skipped += group_filter.take_stats()["rollout/groups_skipped"]
        executor.set_version(step + 1)
    executor.pause()  # let the running episodes finish: the counters are then still
    deadline = time.monotonic() + 60
    while executor.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    s = executor.stats()
    assert skipped > 0 and s["rejected"] < skipped  # most even rows were never generated
    # Replay after a restart covers exactly the rows queued or finished but not trained on.
    assert executor.feed.pending() == s["queued"] + s["ready"]


class AcceptFrom:
    """A GroupFilter: every item starts; groups of items from `first` on are accepted."""

    def __init__(self, first: int):
        self.first = first

    def should_start(self, data) -> bool:
        return True

    def should_accept(self, data, group) -> bool:
        return bool(group["item"][0] >= self.first)


def test_refused_groups_are_replaced_at_once_not_on_the_next_poll(engine_factory, monkeypatch):
    """Each refusal starts a queued item, and prepare_batch tops the queue up as soon as it
    runs low: with the poll interval made 2 minutes, a batch behind 12 refused items (6 top-
    ups) still arrives promptly. Before, the queue was topped up once per poll."""
    import arealite.rollout.admission as admission_module

    monkeypatch.setattr(admission_module, "POLL_S", 120.0)
    executor = engine_factory(consumer_batch_size=2, max_head_offpolicyness=0)
    loader = DataLoader([{"id": i} for i in range(40)], batch_size=2, collate_fn=lambda x: x)
    out = []
    worker = threading.Thread(
        target=lambda: out.append(executor.prepare_batch(loader, OneGeneration(), AcceptFrom(12))),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=60)
    assert out, f"prepare_batch still waiting after 60 s: {executor.stats()}"
    assert sorted(out[0]["item"].tolist()) == [12, 13] and executor.stats()["rejected"] == 12


def test_pause_and_resume_new_episodes(engine_factory):
    executor = engine_factory(consumer_batch_size=4)
    executor.pause()
    executor.submit({"id": 1}, OneGeneration())
    with pytest.raises(TimeoutError):
        executor.wait(1, timeout=1.0)
    assert executor.stats()["queued"] == 1
    executor.resume()
    assert executor.wait(1, timeout=120)["item"].tolist() == [1]


def test_state_dict_restores_the_staleness_budget(engine_factory):
    executor = engine_factory(consumer_batch_size=2)
    assert executor.get_capacity() == 2
    state = {"submitted": 10, "accepted": 10, "rejected": 1, "failed": 0}
    executor.load_state_dict(state)
    assert executor.state_dict() == {**state, "position": None, "done": []}
    assert executor.get_capacity() <= 0  # version 0 already spent
    executor.set_version(5)  # (0 + 5 + 1) * 2 - 10
    assert executor.get_capacity() == 2


def test_destroy_cancels_episodes_and_joins_thread(server):
    before = len(rollout_threads())
    executor = make_executor(server, consumer_batch_size=4)
    engine = executor.engine
    assert len(rollout_threads()) == before + 1
    for i in range(3):
        executor.submit({"id": i}, Forever())
    executor.submit({"id": 3}, OneGeneration(1000, ignore_eos=True))  # an HTTP request in flight
    deadline = time.monotonic() + 10
    while executor.stats()["running"] < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    start = time.monotonic()
    executor.destroy()
    assert time.monotonic() - start < 10
    assert len(rollout_threads()) == before
    s = executor.stats()
    assert (s["running"], s["failed"]) == (0, 0)
    # The cancelled episode cancelled its request on the client: no answer was counted.
    assert engine.stats()["generate_calls"] == 0
    assert not engine.failed  # cancelling a request is not a server failure
    engine.destroy()
    assert engine.http.closed
    with pytest.raises(RuntimeError, match="not running"):
        executor.submit({"id": 0}, Forever())
