"""RemoteSGLangEngine against real embedded servers (python -m arealite.server) on loopback."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
import urllib.request

import pytest

from arealite.api.cli_args import RolloutConfig
from arealite.api.io_struct import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
from arealite.inference.remote_base import NoServerAvailable, ServerError
from arealite.inference.sglang_remote import RemoteSGLangEngine
from arealite.server.process import launch_server
from arealite.utils.network import find_free_port

pytestmark = pytest.mark.integration

API_KEY = "test-key"
PROMPT = [5, 6, 7, 8, 9]


def launch_many(model_path: str, n: int, **kw):
    """Start n servers concurrently (model loading dominates; overlap it)."""
    out, errors = [None] * n, []

    def start(i):
        try:
            out[i] = launch_server(model_path, **{"dtype": "float32", **kw})
        except Exception as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in out:
            if s is not None:
                s.stop()
        raise errors[0]
    return out


def metrics(server) -> dict[str, float]:
    req = urllib.request.Request(f"{server.url}/metrics", headers=server.headers)
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(arealite_\w+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def n_finished(server) -> float:
    m = metrics(server)
    return sum(v for k, v in m.items() if k.startswith("arealite_requests_total"))


async def until(cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout}s")
        await asyncio.sleep(0.02)


def make_engine(addrs, **kw) -> RemoteSGLangEngine:
    kw.setdefault("api_key", API_KEY)
    kw.setdefault("setup_timeout", 60)
    engine = RemoteSGLangEngine(RolloutConfig(**kw))
    engine.initialize(addrs)
    return engine


def gen(max_new_tokens: int, **kw) -> GenerationHyperparameters:
    return GenerationHyperparameters(max_new_tokens=max_new_tokens, **kw)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = launch_server(tiny_model_dir, api_key=API_KEY, dtype="float32")
    yield s
    s.stop()


@pytest.fixture
def engine(server):
    e = make_engine([server.address])
    yield e
    e.destroy()


def test_64_concurrent_agenerate(engine):
    g = gen(6, temperature=1.0)

    async def run():
        reqs = [ModelRequest(input_ids=PROMPT + [i % 50], gconfig=g) for i in range(64)]
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    resps = asyncio.run(run())
    assert len(resps) == 64
    for r in resps:
        assert 1 <= r.output_len <= 6
        assert len(r.output_logprobs) == len(r.output_versions) == r.output_len
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.output_logprobs)
        assert r.output_versions == [0] * r.output_len
        assert r.stop_reason in ("stop", "length")
        assert (r.stop_reason == "length") == (r.output_len == 6 and r.output_tokens[-1] != 2)
        assert r.latency >= r.ttft > 0
    assert engine.stats()["generate_calls"] == 64


def test_bad_requests_are_named_and_server_survives(engine, server):
    async def run(req):
        return await engine.agenerate(req)

    with pytest.raises(ServerError, match=r"input_ids\[1\]: token id 99999"):
        asyncio.run(run(ModelRequest(input_ids=[5, 99999], gconfig=gen(2))))
    with pytest.raises(ValueError, match="n_samples"):
        asyncio.run(run(ModelRequest(input_ids=PROMPT, gconfig=gen(2, n_samples=2))))
    with pytest.raises(ValueError, match="input_ids is empty"):
        asyncio.run(run(ModelRequest(input_ids=[], gconfig=gen(2))))
    assert not engine.failed and server.alive()
    assert asyncio.run(run(ModelRequest(input_ids=PROMPT, gconfig=gen(2)))).output_len >= 1


def test_missing_api_key_is_reported(server):
    engine = make_engine([server.address], api_key=None)
    try:
        with pytest.raises(ServerError, match="401.*unauthorized"):
            asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=gen(2))))
    finally:
        engine.destroy()


def test_health_check_names_unreachable_server(server):
    dead = f"127.0.0.1:{find_free_port()}"
    cfg = RolloutConfig(setup_timeout=1.0, api_key=API_KEY)
    engine = RemoteSGLangEngine(cfg)
    with pytest.raises(TimeoutError, match=re.escape(dead)) as info:
        engine.initialize([server.address, dead])
    assert server.address not in str(info.value)
    with pytest.raises(RuntimeError, match="not running"):  # the client's loop is stopped
        engine.run_coroutine(asyncio.sleep(0))


def test_addresses_from_environment(server, monkeypatch):
    monkeypatch.setenv("AREAL_LLM_SERVER_ADDRS", f"http://{server.address}/")
    engine = make_engine(None)
    try:
        assert engine.addresses == [server.address]
    finally:
        engine.destroy()
    monkeypatch.delenv("AREAL_LLM_SERVER_ADDRS")
    with pytest.raises(ValueError, match="AREAL_LLM_SERVER_ADDRS"):
        RemoteSGLangEngine(RolloutConfig()).initialize()


@pytest.mark.parametrize("pause_mode", ["abort", "in_place"])
def test_generation_goes_on_across_a_weight_update(
    pause_mode, tiny_model_dir, tiny_model_dir_v2, weight_roots
):
    """abort: in-flight requests come back aborted and are resumed as prompt + tokens so far;
    in_place: they stay on the server, KV caches kept. Either way every request gets its whole
    budget and each token the version that produced it."""
    server = launch_server(
        tiny_model_dir, api_key=API_KEY, extra_args=weight_roots, dtype="float32"
    )
    engine = make_engine([server.address], pause_mode=pause_mode)
    try:
        greedy = gen(8, greedy=True)
        before = asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=greedy)))
        budget, n = 64, 4
        sampled = gen(budget, temperature=1.0, ignore_eos=True)

        async def scenario():
            start = metrics(server)["arealite_generation_tokens_total"]
            tasks = [
                asyncio.ensure_future(
                    engine.agenerate(ModelRequest(input_ids=PROMPT + [i], gconfig=sampled))
                )
                for i in range(n)
            ]
            # Update once every request has produced a few tokens, long before any finishes.
            await until(
                lambda: metrics(server)["arealite_generation_tokens_total"] - start >= 4 * n,
                what="first tokens",
            )
            await asyncio.wrap_future(
                engine.update_weights(WeightUpdateMeta.from_disk(tiny_model_dir_v2, version=1))
            )
            return await asyncio.gather(*tasks)

        resps = asyncio.run(scenario())
        m = metrics(server)
        aborted = m['arealite_requests_total{finish_reason="abort"}']
        prompt_tokens = m["arealite_prompt_tokens_total"] - before.input_len
        if pause_mode == "abort":
            assert aborted >= 1 and engine.stats()["aborted_chunks"] >= 1
            assert prompt_tokens > n * (len(PROMPT) + 1)  # resubmissions prefilled again
        else:
            assert aborted == 0 and engine.stats()["aborted_chunks"] == 0
            assert prompt_tokens == n * (len(PROMPT) + 1)  # each prompt prefilled once
        assert engine.weight_version == 1
        for r in resps:
            assert r.output_len == budget  # the budget spans the resubmission exactly
            assert r.output_versions == sorted(r.output_versions)
            assert r.output_versions[-1] == 1
            assert all(math.isfinite(lp) for lp in r.output_logprobs)
        assert any(set(r.output_versions) == {0, 1} for r in resps)

        after = asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=greedy)))
        assert after.output_versions == [1] * after.output_len
        assert after.output_tokens != before.output_tokens

        # A failed load is reported with the server's reason; the server stays in rotation.
        bad = WeightUpdateMeta.from_disk("/nonexistent/weights", version=2)
        with pytest.raises(RuntimeError, match="/nonexistent/weights"):
            engine.update_weights(bad).result(timeout=60)
        assert not engine.failed and engine.weight_version == 1
        again = asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=greedy)))
        assert again.output_tokens == after.output_tokens
    finally:
        engine.destroy()
        server.stop()


def test_sticky_routing_and_failover_when_a_server_dies(tiny_model_dir):
    a, b = launch_many(tiny_model_dir, 2, api_key=API_KEY)
    # setup_timeout also bounds the wait for a server to come back once all have failed.
    engine = make_engine([a.address, b.address], request_retries=1, setup_timeout=5)
    try:
        g = gen(2)

        async def same_rid(k):
            for _ in range(k):
                await engine.agenerate(ModelRequest(rid="sticky", input_ids=PROMPT, gconfig=g))

        asyncio.run(same_rid(3))
        counts = sorted([n_finished(a), n_finished(b)])
        assert counts == [0, 3]

        async def distinct(k):
            await asyncio.gather(
                *(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)) for _ in range(k))
            )

        asyncio.run(distinct(4))
        assert n_finished(a) >= 2 and n_finished(b) >= 2  # round-robin spreads new rids

        budget = 32
        sampled = gen(budget, temperature=1.0, ignore_eos=True)

        async def kill_b_midway():
            tasks = [
                asyncio.ensure_future(
                    engine.agenerate(ModelRequest(input_ids=PROMPT + [i], gconfig=sampled))
                )
                for i in range(12)
            ]
            await until(
                lambda: (
                    metrics(b)["arealite_running_requests"] > 0
                    and metrics(b)["arealite_generation_tokens_total"] > 20
                ),
                what="requests running on b",
            )
            b.proc.kill()
            return await asyncio.gather(*tasks)

        resps = asyncio.run(kill_b_midway())
        assert len(resps) == 12
        assert all(r.output_len == budget for r in resps)
        assert list(engine.failed) == [b.address]
        assert engine.stats()["failovers"] >= 1

        a.stop()
        with pytest.raises(NoServerAvailable) as info:
            asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
        assert a.address in str(info.value) and b.address in str(info.value)
    finally:
        engine.destroy()
        a.stop()
        b.stop()


def test_nccl_update_errors_are_clear_and_release_the_pause(engine):
    meta = WeightUpdateMeta.from_nccl("127.0.0.1", find_free_port(), version=1)
    with pytest.raises(ValueError, match="nccl_param_specs"):
        engine.update_weights(meta).result(timeout=60)
    # The embedded server has no NCCL path: every server's refusal is reported, and
    # generation is allowed again afterwards.
    meta.nccl_param_specs = [[("model.embed_tokens.weight", [8, 4], "float32")]]
    with pytest.raises(RuntimeError, match="init_weights_update_group failed on every server.*501"):
        engine.update_weights(meta).result(timeout=60)
    assert engine.weight_version == 0 and not engine.failed
    resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=gen(2))))
    assert resp.output_versions == [0] * resp.output_len


def post(server, path: str) -> None:
    req = urllib.request.Request(f"{server.url}{path}", data=b"{}", headers=server.headers)
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30):
        pass


def test_abort_by_someone_else_is_resumed(engine, server):
    """A pause we did not ask for aborts the request; it is resubmitted at once and finishes
    with its whole budget once the server continues."""
    budget = 48

    async def scenario():
        start = metrics(server)["arealite_generation_tokens_total"]
        task = asyncio.ensure_future(
            engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=gen(budget, ignore_eos=True)))
        )
        await until(lambda: metrics(server)["arealite_generation_tokens_total"] - start >= 4)
        await asyncio.to_thread(post, server, "/pause_generation")
        await asyncio.sleep(0.3)
        assert not task.done()  # held by the paused server, not failed
        await asyncio.to_thread(post, server, "/continue_generation")
        return await task

    aborted_before = engine.stats()["aborted_chunks"]
    resp = asyncio.run(scenario())
    assert resp.output_len == budget and resp.stop_reason == "length"
    assert engine.stats()["aborted_chunks"] == aborted_before + 1


def test_a_group_is_one_batch_call_sampling_as_single_calls_do(engine):
    """agenerate_group sends SGLang's batch form: one call for 4 seeded samples, each the
    tokens and logprobs the same request gets alone (seeded draws ignore batch-mates)."""
    reqs = [ModelRequest(input_ids=PROMPT, gconfig=gen(6, seed=100 + i)) for i in range(4)]
    calls = engine.stats()["generate_calls"]
    group = asyncio.run(engine.agenerate_group(reqs))
    assert engine.stats()["generate_calls"] == calls + 1
    alone = [asyncio.run(engine.agenerate(r)) for r in reqs]
    assert [r.output_tokens for r in group] == [r.output_tokens for r in alone]
    assert len({tuple(r.output_tokens) for r in group}) > 1  # the seeds sample apart
    for g, a in zip(group, alone):
        assert g.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-5)
        assert g.input_tokens == PROMPT and g.stop_reason == a.stop_reason


def test_an_aborted_group_resumes_together_with_its_whole_budget(engine, server):
    budget, n = 48, 3
    reqs = [ModelRequest(input_ids=PROMPT, gconfig=gen(budget, ignore_eos=True)) for _ in range(n)]

    async def scenario():
        start = metrics(server)["arealite_generation_tokens_total"]
        task = asyncio.ensure_future(engine.agenerate_group(reqs))
        await until(lambda: metrics(server)["arealite_generation_tokens_total"] - start >= 4 * n)
        await asyncio.to_thread(post, server, "/pause_generation")
        await asyncio.sleep(0.3)
        assert not task.done()
        await asyncio.to_thread(post, server, "/continue_generation")
        return await task

    before = engine.stats()
    resps = asyncio.run(scenario())
    assert [r.output_len for r in resps] == [budget] * n
    assert all(r.stop_reason == "length" and len(r.output_logprobs) == budget for r in resps)
    after = engine.stats()
    assert after["aborted_chunks"] == before["aborted_chunks"] + n
    assert after["generate_calls"] == before["generate_calls"] + 2  # the batch, then its rest


def test_a_weight_rollback_is_refused_and_the_trainer_sees_it(server, tiny_model_dir, monkeypatch):
    """A stray trainer (an older owner of the run, or the same one going back) cannot roll
    the server's weights back: update_weights raises naming the server and both versions."""
    from arealite.lifecycle.run_lock import FENCING_TOKEN_ENV

    engine = make_engine([server.address])
    try:
        monkeypatch.setenv(FENCING_TOKEN_ENV, "100")
        engine.update_weights(WeightUpdateMeta.from_disk(tiny_model_dir, version=50)).result(60)
        monkeypatch.setenv(FENCING_TOKEN_ENV, "99")  # the previous owner, still running
        with pytest.raises(RuntimeError, match=rf"{server.address}.*409.*fencing token 99"):
            engine.update_weights(WeightUpdateMeta.from_disk(tiny_model_dir, version=60)).result(60)
        monkeypatch.setenv(FENCING_TOKEN_ENV, "100")
        with pytest.raises(RuntimeError, match="version 49 is older than the served version 50"):
            engine.update_weights(WeightUpdateMeta.from_disk(tiny_model_dir, version=49)).result(60)
        assert not engine.pool.failed  # a refusal is an error, not a dead server
    finally:
        engine.destroy()


def test_a_server_serving_older_weights_than_loaded_elsewhere_is_taken_out(tiny_model_dir):
    """A server answering with weights older than the version the trainer loaded on every
    live server (it restarted behind this client's back) is taken out and the request is
    generated again elsewhere: no answer from stale weights reaches the caller."""
    a, b = launch_many(tiny_model_dir, 2, api_key=API_KEY)
    trainer = make_engine([a.address])  # b never gets version 2: it stands for a restarted server
    client = make_engine([a.address, b.address], request_retries=1)
    try:
        trainer.update_weights(WeightUpdateMeta.from_disk(tiny_model_dir, version=2)).result(60)
        client.expect_weight_version(2)
        g = gen(2, ignore_eos=True)

        async def run():
            reqs = [ModelRequest(input_ids=PROMPT + [i], gconfig=g) for i in range(4)]
            return await asyncio.gather(*(client.agenerate(r) for r in reqs))

        assert [r.output_versions for r in asyncio.run(run())] == [[2, 2]] * 4
        assert n_finished(a) >= 4
        assert client.stats()["servers_failed"] >= 1
    finally:
        trainer.destroy()
        client.destroy()
        a.stop()
        b.stop()


def test_quick_weight_loads_log_at_info_only_the_first_time(
    engine, tiny_model_dir, monkeypatch, caplog
):
    """One INFO line a step would bury a CPU run's progress lines; the first load and any slow
    one still say it."""
    from arealite.inference import remote_weights

    def load(version: int) -> None:
        meta = WeightUpdateMeta.from_disk(tiny_model_dir, version=version)
        engine.update_weights(meta).result(timeout=60)

    with caplog.at_level(logging.DEBUG, logger="arealite.remote"):
        monkeypatch.setattr(remote_weights, "SLOW_LOAD_S", 600.0)  # every load here is quick
        for version in (1000, 1001, 1002):  # past the versions earlier tests loaded
            load(version)
        monkeypatch.setattr(remote_weights, "SLOW_LOAD_S", 0.0)  # every load here is slow
        load(1003)
    levels = [r.levelno for r in caplog.records if "loaded on 1 server(s)" in r.getMessage()]
    assert levels == [logging.INFO, logging.DEBUG, logging.DEBUG, logging.INFO]
