"""The embedded inference server: a real `python -m arealite.server` process on a free port.

Checks the SGLang wire subset end to end: batched generation whose logprobs equal a plain
forward pass, sampling controls, pause/continue, weight reload, auth and malformed input.
"""

from __future__ import annotations

import asyncio
import math
import re
import time

import aiohttp
import pytest
import requests
import torch
from _teacher_forced import forward_logits, logprobs_of, teacher_forced_logprobs

from arealite.server.model_runner import Sequence
from arealite.server.process import launch_server
from arealite.server.protocol import GenerateRequest, SamplingParams

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


# ---- helpers -------------------------------------------------------------------------------------
def post(server, path: str, body=None, *, data: bytes | None = None, headers=AUTH, timeout=120):
    r = requests.post(f"{server.url}{path}", json=body, data=data, headers=headers, timeout=timeout)
    return r.status_code, r.json()


def load_from_disk(server, model_path: str, version: int | None = None, **extra):
    """POST /update_weights_from_disk; (status, body)."""
    body = {"model_path": model_path, **extra}
    if version is not None:
        body["weight_version"] = version
    return post(server, "/update_weights_from_disk", body)


def generate(server, input_ids, return_logprob=True, **sampling) -> dict:
    status, out = post(
        server,
        "/generate",
        {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": return_logprob},
    )
    assert status == 200, out
    return out


async def _generate_all(server, bodies, delays) -> list[dict]:
    async with aiohttp.ClientSession(headers=AUTH, connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(body, delay):
            await asyncio.sleep(delay)
            async with s.post(f"{server.url}/generate", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        return await asyncio.gather(*(one(b, d) for b, d in zip(bodies, delays)))


def metric(server, name: str) -> float:
    text = requests.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
    m = re.search(rf"^arealite_{name} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


def prompts(n: int, seed: int = 0, vocab: int = 600) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            3, vocab, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir, weight_roots):
    extra = [*weight_roots, "--log-interval", "2"]
    with launch_server(tiny_model_dir, dtype="float32", api_key=API_KEY, extra_args=extra) as s:
        yield s
        assert s.alive(), s.log_tail()


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


# ---- generation ----------------------------------------------------------------------------------
@pytest.mark.integration
def test_64_concurrent_requests_batch_and_logprobs_match_forward(server, ref_model):
    """Two waves (the second joins a running batch), per-request params, varied lengths."""
    temps = [0.0, 0.7, 1.0, 1.3]
    bodies = []
    for i, p in enumerate(prompts(64)):
        sp = {
            "max_new_tokens": 8 + (i % 5) * 6,
            "temperature": temps[i % 4],
            "ignore_eos": i % 2 == 0,
        }
        if i % 8 == 3:
            sp.update(top_k=20, top_p=0.9)
        bodies.append({"input_ids": p, "sampling_params": sp, "return_logprob": True})
    delays = [0.0] * 32 + [0.15] * 32
    steps_before = metric(server, "decode_steps_total")
    results = asyncio.run(_generate_all(server, bodies, delays))

    for body, res in zip(bodies, results):
        out, meta, sp = res["output_ids"], res["meta_info"], body["sampling_params"]
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert meta["completion_tokens"] == len(out) > 0
        assert meta["prompt_tokens"] == len(body["input_ids"])
        assert len(out) <= sp["max_new_tokens"]
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == out
        got = torch.tensor([lp for lp, _, _ in lps])
        assert torch.isfinite(got).all()
        logits = forward_logits(ref_model, body["input_ids"], out)
        want = logprobs_of(logits, out, sp["temperature"] or 1.0)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        if sp["temperature"] == 0:  # greedy: every token is (within float noise) the argmax
            top = logits.max(-1).values
            chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
            assert (top - chosen <= 1e-4).all()
    assert metric(server, "max_batch_size") > 1
    # Batched: far fewer forward steps than the 64 requests' generated tokens.
    n_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    assert metric(server, "decode_steps_total") - steps_before < n_tokens / 4


@pytest.mark.integration
def test_batch_form_answers_a_list_in_order(server):
    """SGLang's batch form: prompts with per-prompt rids and params (or one shared dict),
    answered in order; each answer is what the prompt gets alone."""
    p, q = [5, 6, 7, 8], [9, 10]
    sp = [
        {"max_new_tokens": 5, "sampling_seed": 1, "ignore_eos": True},
        {"max_new_tokens": 5, "sampling_seed": 2, "ignore_eos": True},
        {"max_new_tokens": 0},
    ]
    body = {"input_ids": [p, p, q], "rid": ["a", "b", "c"], "sampling_params": sp}
    status, out = post(server, "/generate", {**body, "return_logprob": True})
    assert status == 200 and isinstance(out, list), out
    assert [o["meta_info"]["id"] for o in out] == ["a", "b", "c"]
    assert [len(o["output_ids"]) for o in out] == [5, 5, 0]
    for ids, params, o in zip([p, p], sp, out):
        alone = generate(server, ids, **params)
        assert o["output_ids"] == alone["output_ids"]
        got = [e[0] for e in o["meta_info"]["output_token_logprobs"]]
        want = [e[0] for e in alone["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-5)
    shared = {"input_ids": [p, q], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    status, out = post(server, "/generate", shared)
    assert status == 200 and [len(o["output_ids"]) for o in out] == [2, 2]


@pytest.mark.integration
def test_greedy_is_deterministic_and_top_k_1_or_tiny_top_p_equal_greedy(server):
    p = prompts(1, seed=3)[0]
    greedy = generate(server, p, max_new_tokens=24, temperature=0, ignore_eos=True)
    again = generate(server, p, max_new_tokens=24, temperature=0, ignore_eos=True)
    top_k1 = generate(server, p, max_new_tokens=24, temperature=1.0, top_k=1, ignore_eos=True)
    top_p0 = generate(server, p, max_new_tokens=24, temperature=1.0, top_p=1e-6, ignore_eos=True)
    assert (
        greedy["output_ids"] == again["output_ids"] == top_k1["output_ids"] == top_p0["output_ids"]
    )
    assert (
        greedy["meta_info"]["output_token_logprobs"] == again["meta_info"]["output_token_logprobs"]
    )


@pytest.mark.integration
def test_max_new_tokens_and_stop_token_ids_and_min_new_tokens(server):
    p = prompts(1, seed=4)[0]
    out = generate(server, p, max_new_tokens=7, temperature=1.0, ignore_eos=True)
    assert len(out["output_ids"]) == 7
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    empty = generate(server, p, max_new_tokens=0)
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"

    base = generate(server, p, max_new_tokens=20, temperature=0, ignore_eos=True)["output_ids"]
    stop = base[4]
    cut = base.index(stop) + 1
    stopped = generate(
        server, p, max_new_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop]
    )
    assert stopped["output_ids"] == base[:cut]  # the stop token is included, as SGLang does
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    first = base[0]
    held = generate(
        server,
        p,
        max_new_tokens=20,
        temperature=0,
        ignore_eos=True,
        stop_token_ids=[first],
        min_new_tokens=3,
    )["output_ids"]
    assert first not in held[:3] and len(held) >= 3
    assert first not in held[:-1]  # finishes at the first allowed occurrence (or by length)


@pytest.mark.integration
def test_pause_aborts_in_flight_and_holds_new_requests_until_continue(server):
    n, budget = 6, 1900
    body = {
        "sampling_params": {"max_new_tokens": budget, "ignore_eos": True},
        "return_logprob": True,
    }

    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as s:

            async def gen(ids, b=body):
                async with s.post(f"{server.url}/generate", json={**b, "input_ids": ids}) as r:
                    assert r.status == 200
                    return await r.json()

            tasks = [asyncio.create_task(gen(p)) for p in prompts(n, seed=5)]
            deadline = time.monotonic() + 60
            while metric(server, "running_requests") < n:
                assert time.monotonic() < deadline, "requests never started"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            async with s.post(f"{server.url}/pause_generation", json={}) as r:
                assert r.status == 200
            aborted = await asyncio.wait_for(asyncio.gather(*tasks), 30)

            short = {"sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
            late = asyncio.create_task(gen([5, 6, 7], short))
            await asyncio.sleep(0.5)
            assert not late.done(), "a request completed while generation was paused"
            async with s.post(f"{server.url}/continue_generation", json={}) as r:
                assert r.status == 200
            return aborted, await asyncio.wait_for(late, 30)

    aborted, late = asyncio.run(scenario())
    for res in aborted:
        meta = res["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < meta["completion_tokens"] < budget
        assert (
            len(res["output_ids"])
            == len(meta["output_token_logprobs"])
            == meta["completion_tokens"]
        )
    assert late["meta_info"]["finish_reason"]["type"] == "length"
    assert len(late["output_ids"]) == 5


@pytest.mark.integration
def test_update_weights_from_disk_changes_outputs_and_version(
    server, tiny_model_dir, tiny_model_dir_v2
):
    p = prompts(1, seed=6)[0]
    sp = dict(max_new_tokens=16, temperature=0, ignore_eos=True)
    before = generate(server, p, **sp)
    v0 = before["meta_info"]["weight_version"]

    status, res = load_from_disk(server, tiny_model_dir_v2, v0 + 1)
    assert status == 200 and res["success"], res
    after = generate(server, p, **sp)
    assert after["meta_info"]["weight_version"] == v0 + 1
    assert after["output_ids"] != before["output_ids"]
    info = requests.get(f"{server.url}/get_model_info", headers=AUTH).json()
    assert info["weight_version"] == v0 + 1

    status, res = load_from_disk(server, "/", 99)
    assert status == 403 and not res["success"] and "allowed weight roots" in res["message"]
    status, res = load_from_disk(server, tiny_model_dir + "_nope")
    assert status == 400 and not res["success"]

    status, res = load_from_disk(server, tiny_model_dir, v0 + 2)
    assert status == 200 and res["success"], res
    restored = generate(server, p, **sp)
    assert restored["output_ids"] == before["output_ids"]
    assert restored["meta_info"]["weight_version"] == v0 + 2


@pytest.mark.integration
def test_weight_versions_only_move_forward_unless_a_newer_owner_pushes(server, tiny_model_dir):
    """A stray trainer cannot roll the weights back (409 naming both versions); the run's new
    owner (a higher fencing token, e.g. a resumed run) may restore an older version."""

    def push(version, **extra):
        return load_from_disk(server, tiny_model_dir, version, **extra)

    served = requests.get(f"{server.url}/get_weight_version", headers=AUTH).json()
    v = served["weight_version"] + 10
    assert push(v)[0] == 200
    status, res = push(v - 1)
    assert status == 409 and not res["success"], res
    assert f"version {v - 1} is older than the served version {v}" in res["message"]
    assert res["served_version"] == v
    assert push(v)[0] == 200  # the same version again (a resume, a re-admission) is fine

    assert push(v - 5, fencing_token=7)[0] == 200  # a new owner restores its checkpoint
    status, res = push(v + 1, fencing_token=6)  # the previous owner, still running somewhere
    assert status == 409 and "fencing token 6 is older than 7" in res["message"], res
    status, res = push(v - 6)  # no token: the current owner, so versions must not go back
    assert status == 409, res
    got = requests.get(f"{server.url}/get_weight_version", headers=AUTH).json()
    assert got["weight_version"] == v - 5
    assert load_from_disk(server, tiny_model_dir, fencing_token="x")[0] == 400


@pytest.mark.integration
def test_weights_load_only_from_allowed_roots_checked_before_reading(
    tiny_model_dir, tiny_model_dir_v2, tmp_path
):
    """A standalone server loads only from its model's folder: outside paths, symlinks that
    lead out and files that link out are refused with 403 before anything is read (a FIFO
    outside the roots would block a reader forever)."""
    import os
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    shutil.copytree(tiny_model_dir_v2, model / "step1")  # inside the root: allowed
    (model / "escape").symlink_to(tiny_model_dir_v2, target_is_directory=True)
    (model / "half").mkdir()
    for f in os.listdir(tiny_model_dir_v2):
        (model / "half" / f).symlink_to(os.path.join(tiny_model_dir_v2, f))
    trap = tmp_path / "trap"
    trap.mkdir()
    for f in ("config.json", "model.safetensors"):
        os.mkfifo(trap / f)
    with launch_server(str(model), dtype="float32", api_key=API_KEY) as s:

        def load(path, version):
            return post(
                s,
                "/update_weights_from_disk",
                {"model_path": str(path), "weight_version": version},
                timeout=20,
            )

        for path in ("/etc", trap, model / "escape", model / "half", tmp_path):
            status, res = load(path, 1)
            assert status == 403 and "outside the allowed weight roots" in res["message"], res
        status, res = load(model / "step1", 1)
        assert status == 200 and res["success"], res
        assert s.alive()


@pytest.mark.integration
def test_client_disconnect_frees_its_batch_slot(server):
    aborted = metric(server, 'requests_total{finish_reason="abort"}')
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
    with pytest.raises(requests.exceptions.Timeout):
        requests.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=1.0)
    deadline = time.monotonic() + 30
    while metric(server, 'requests_total{finish_reason="abort"}') < aborted + 1:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.1)
    assert metric(server, "running_requests") == 0


# ---- robustness ----------------------------------------------------------------------------------
BAD_BODIES = [
    (b'{"sampling_params": {}}', "input_ids"),
    (b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
    (b"this is not json", "JSON"),
    (b'{"input_ids": [5, "\xff"]}', "UTF-8"),
    (b"[1, 2]", "body"),
    (b'{"input_ids": []}', "input_ids"),
    (b'{"input_ids": [5, "x"]}', "input_ids[1]"),
    (b'{"input_ids": [5, 100000]}', "vocabulary"),
    (b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 5000}}', "max_position_embeddings"),
    (b'{"input_ids": [5], "sampling_params": {"temperature": "hot"}}', "temperature"),
    (b'{"input_ids": [5], "sampling_params": {"top_p": 0}}', "top_p"),
    (b'{"input_ids": [5], "sampling_params": {"stop_token_ids": [100000]}}', "stop_token_ids"),
    (b'{"input_ids": [5], "sampling_params": {"bogus": 1}}', "bogus"),
    (b'{"input_ids": [[5, 6], [7, "x"]]}', "batch item 1: input_ids[1]"),
    (b'{"input_ids": [5, [6]]}', "input_ids[1]: a batch must be a list of prompts"),
    (b'{"input_ids": [[5], [6]], "rid": ["a"]}', "rid: 1 values for a batch of 2"),
    (b'{"input_ids": [[5], [6]], "rid": ["a", "a"]}', "'a' appears more than once"),
    (b'{"input_ids": [[5], [6]], "rid": "a"}', "rid: a batch needs a list"),
    (b'{"input_ids": [[5], [6]], "sampling_params": [{}, {"top_p": 0}]}', "batch item 1: sampling"),
]


@pytest.mark.integration
@pytest.mark.parametrize("raw,needle", BAD_BODIES, ids=[n for _, n in BAD_BODIES])
def test_malformed_generate_is_400_naming_the_field(server, raw, needle):
    status, res = post(
        server, "/generate", data=raw, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert status == 400 and needle in res["error"], res


@pytest.mark.integration
def test_auth_and_server_survives_bad_requests(server):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert post(server, "/generate", body, headers={})[0] == 401
    assert post(server, "/generate", body, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert requests.get(f"{server.url}/metrics", timeout=10).status_code == 401
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200  # exempt
    for raw, _ in BAD_BODIES:
        post(server, "/generate", data=raw)
    status, res = post(server, "/generate", body)
    assert status == 200 and len(res["output_ids"]) == 3
    assert server.alive()


@pytest.mark.integration
def test_introspection_endpoints(server, tiny_model_dir):
    info = requests.get(f"{server.url}/get_model_info", headers=AUTH, timeout=10).json()
    assert info["model_path"] == tiny_model_dir and info["dtype"] == "float32"
    assert (
        requests.get(f"{server.url}/get_server_info", headers=AUTH, timeout=10).json()["tp_size"]
        == 1
    )
    assert post(server, "/flush_cache")[0] == 200
    generate(server, [5, 6], max_new_tokens=2, ignore_eos=True)
    assert metric(server, 'requests_total{finish_reason="length"}') > 0
    assert metric(server, "generation_tokens_total") > 0


@pytest.mark.integration
def test_distributed_weight_push_over_gloo(server, tiny_model_dir, tiny_model_dir_v2):
    """This process plays trainer rank 0 and broadcasts v2 weights in two buckets."""
    import concurrent.futures

    import torch.distributed as dist
    from safetensors.torch import load_file

    from arealite.utils.distributed import init_custom_process_group
    from arealite.utils.network import find_free_port

    p = prompts(1, seed=7)[0]
    sp = dict(max_new_tokens=16, temperature=0, ignore_eos=True)
    assert load_from_disk(server, tiny_model_dir_v2)[0] == 200
    want = generate(server, p, **sp)["output_ids"]
    assert load_from_disk(server, tiny_model_dir)[0] == 200
    assert generate(server, p, **sp)["output_ids"] != want

    if not torch.cuda.is_available():  # NCCL on a CPU server: a clear refusal, not a hang
        status, res = post(
            server,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 1234,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "g",
                "backend": "nccl",
            },
        )
        assert status == 501 and "nccl" in res["message"]

    port, name = find_free_port(), "test_weight_group"
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": name,
        "backend": "gloo",
    }
    pool = concurrent.futures.ThreadPoolExecutor(2)
    joined = pool.submit(post, server, "/init_weights_update_group", init)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, name)
    try:
        status, res = joined.result(60)
        assert status == 200 and res["success"], res
        state = load_file(f"{tiny_model_dir_v2}/model.safetensors")
        names = sorted(state)
        buckets = [names[: len(names) // 2], names[len(names) // 2 :]]
        for i, bucket in enumerate(buckets):
            body = {
                "names": bucket,
                "dtypes": [str(state[n].dtype) for n in bucket],
                "shapes": [list(state[n].shape) for n in bucket],
                "group_name": name,
            }
            if i == len(buckets) - 1:
                body["weight_version"] = "42"
            fut = pool.submit(post, server, "/update_weights_from_distributed", body)
            for n in bucket:
                dist.broadcast(state[n].contiguous(), src=0, group=group)
            status, res = fut.result(60)
            assert status == 200 and res["success"], res
        out = generate(server, p, **sp)
        assert out["output_ids"] == want and out["meta_info"]["weight_version"] == 42
        assert post(server, "/destroy_weights_update_group", {"group_name": name})[0] == 200
    finally:
        dist.destroy_process_group(group)
        pool.shutdown()
    assert load_from_disk(server, tiny_model_dir)[0] == 200


@pytest.mark.integration
def test_tensor_weight_push_and_its_refusals(server, tiny_model_dir, tiny_model_dir_v2):
    """/update_weights_from_tensor opens handles of this process's tensors (shared memory on
    a CPU, CUDA IPC on a GPU) and serves them; a payload that is not tensor handles (a pickled
    function, garbage, the wrong count or names) is refused with 400 and nothing changes."""
    import base64
    import os
    import pickle

    from safetensors.torch import load_file

    from arealite.utils.tensor_handles import serialize_named_tensors

    p = prompts(1, seed=7)[0]
    sp = dict(max_new_tokens=16, temperature=0, ignore_eos=True)
    assert load_from_disk(server, tiny_model_dir_v2)[0] == 200
    want = generate(server, p, **sp)["output_ids"]
    assert load_from_disk(server, tiny_model_dir)[0] == 200
    before = generate(server, p, **sp)["output_ids"]
    state = load_file(f"{tiny_model_dir_v2}/model.safetensors")
    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    pairs = base64.b64encode(pickle.dumps([1, 2])).decode()
    wrong = serialize_named_tensors([("no.such.weight", torch.zeros(2))])
    for payloads, needle in (
        ([evil], "refused global"),
        (["%%"], "not base64"),
        ([pairs], "(name, tensor) pairs"),
        ([wrong, wrong], "got 2"),
        ([wrong], "no.such.weight"),
    ):
        status, res = post(
            server, "/update_weights_from_tensor", {"serialized_named_tensors": payloads}
        )
        assert status == 400 and needle in str(res), (needle, res)
    assert generate(server, p, **sp)["output_ids"] == before  # nothing was loaded
    body = {
        "serialized_named_tensors": [serialize_named_tensors(sorted(state.items()))],
        "weight_version": "43",
    }
    status, res = post(server, "/update_weights_from_tensor", body)
    assert status == 200 and res["success"], res
    out = generate(server, p, **sp)
    assert out["output_ids"] == want and out["meta_info"]["weight_version"] == 43
    assert load_from_disk(server, tiny_model_dir)[0] == 200


# ---- in-process units (no HTTP) ------------------------------------------------------------------
def test_runner_joins_a_running_batch_with_exact_logprobs(tiny_model_dir, ref_model):
    """A request prefilled mid-decode is left-padded into the running cache, finished rows
    leave with the columns only they used, the cache grows: nothing shifts."""
    from arealite.server.model_runner import ModelRunner
    from arealite.server.protocol import GenerateRequest, SamplingParams

    runner = ModelRunner(tiny_model_dir, dtype="float32", device="cpu")

    def seq(ids, n, t):
        params = SamplingParams(max_new_tokens=n, temperature=t, ignore_eos=True)
        return runner.new_sequence(GenerateRequest(rid=str(ids), input_ids=ids, params=params))

    # 48 tokens: the running rows outgrow their cache buffer's spare columns mid-decode
    first = [seq([5, 6, 7], 48, 1.0), seq(list(range(10, 40)), 4, 0.0)]
    late = [seq(list(range(50, 90)), 6, 0.8), seq([9], 9, 1.0)]
    done = []
    with torch.inference_mode():
        done += runner.step(first)
        done += runner.step([])
        done += runner.step(late)  # joins: longer prompts than the running cache, and shorter
        while runner.num_running:
            done += runner.step([])
    assert len(done) == 4
    for s in done:
        assert len(s.output_ids) == s.req.params.max_new_tokens
        temperature = s.req.params.logprob_temperature
        want = teacher_forced_logprobs(ref_model, s.req.input_ids, s.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), want, atol=1e-4, rtol=0)


def test_a_shared_prompt_is_prefilled_once_and_its_rows_sample_apart(tiny_model_dir, ref_model):
    """A GRPO group (8 rows, one prompt) joining a running batch beside other prompts: the
    prompt is prefilled once (the forward sees 3 distinct rows, not 11), yet every row samples on
    its own with exact logprobs and its own finish."""
    from arealite.server.model_runner import ModelRunner
    from arealite.server.protocol import GenerateRequest, SamplingParams

    runner = ModelRunner(tiny_model_dir, dtype="float32", device="cpu")

    def seq(ids, n):
        params = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
        return runner.new_sequence(GenerateRequest(rid=f"{ids}-{n}", input_ids=ids, params=params))

    rows_seen = []
    runner.model.register_forward_pre_hook(
        lambda _m, _a, kw: rows_seen.append(kw["input_ids"].shape), with_kwargs=True
    )
    group = [seq([11, 12, 13, 14], 6 + i % 3) for i in range(8)]
    others = [seq([5, 6], 7), seq(list(range(20, 45)), 5)]
    done = []
    with torch.inference_mode():
        done += runner.step([seq([7, 8, 9], 9)])  # a running batch to join (first prefill)
        done += runner.step(group + others)
        while runner.num_running:
            done += runner.step([])
    assert (
        rows_seen[2][0] == 3
    )  # after the running row's decode: the group's prompt once, plus the two other prompts
    assert len(done) == 11
    outs = [tuple(s.output_ids) for s in done if s.req.input_ids == [11, 12, 13, 14]]
    assert len(set(outs)) > 1  # the 8 samples drew their own tokens
    for s in done:
        assert len(s.output_ids) == s.req.params.max_new_tokens
        want = teacher_forced_logprobs(ref_model, s.req.input_ids, s.output_ids)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), want, atol=1e-4, rtol=0)


def test_sampling_truncation_and_logprobs():
    from arealite.server.protocol import SamplingParams
    from arealite.server.sampling import SamplingTensors, sample_next_tokens

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.5),
    ]
    st = SamplingTensors.build(params, 5, "cpu")
    g = torch.Generator().manual_seed(0)
    draws = [sample_next_tokens(logits, st, g) for _ in range(200)]
    tokens = torch.stack([t for t, _ in draws])
    assert (tokens[:, 0] == 0).all()  # greedy
    assert set(tokens[:, 1].tolist()) <= {0, 1}  # top-2
    assert (tokens[:, 2] == 0).all()  # nucleus of p=0.5 holds only the top token (p=0.67)
    assert len(set(tokens[:, 3].tolist())) > 1  # plain sampling varies
    tok, lp = draws[0]
    for row, p in enumerate(params):
        want = torch.log_softmax(logits[row] / p.logprob_temperature, -1)[tok[row]]
        assert math.isclose(lp[row].item(), want.item(), abs_tol=1e-6)
    banned = torch.zeros(4, 5, dtype=torch.bool)
    banned[:, 0] = True
    tok, _ = sample_next_tokens(logits, st, g, banned)
    assert tok[0].item() == 1 and (tok != 0).all()


def test_launch_server_reports_startup_failure_with_log_tail(tmp_path):
    with pytest.raises(RuntimeError, match="is not a directory"):
        launch_server(str(tmp_path / "no_model"), timeout=60)


@pytest.mark.integration
def test_a_request_aborted_before_it_starts_reports_the_served_weight_version(
    server, tiny_model_dir
):
    """An abort answer without tokens still says which weights the server serves (clients
    compare it with what they loaded to detect a restarted server: 0 here was a false alarm)."""
    served = requests.get(f"{server.url}/get_weight_version", headers=AUTH).json()
    version = served["weight_version"] + 3
    body = {"model_path": tiny_model_dir, "weight_version": version}
    assert post(server, "/update_weights_from_disk", body)[0] == 200

    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(f"{server.url}/pause_generation", json={}) as r:
                assert r.status == 200
            req = {
                "rid": "queued",
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 4},
            }
            queued = asyncio.create_task(s.post(f"{server.url}/generate", json=req))
            await asyncio.sleep(0.5)  # it waits behind the pause
            async with s.post(f"{server.url}/abort_request", json={"rid": "queued"}) as r:
                assert r.status == 200
            async with await asyncio.wait_for(queued, 30) as r:
                answer = await r.json()
            async with s.post(f"{server.url}/continue_generation", json={}) as r:
                assert r.status == 200
            return answer

    meta = asyncio.run(scenario())["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0
    assert meta["weight_version"] == version


def test_version_spans_mark_where_the_weights_changed_under_a_row():
    req = GenerateRequest(rid="r", input_ids=[1], params=SamplingParams())
    seq = Sequence(req=req, stop_ids=frozenset(), weight_version=3, output_ids=[1, 2])
    assert seq.version_spans() is None  # one version produced everything
    seq.new_weights(4)
    seq.new_weights(5)  # two updates while frozen: nothing came from version 4
    seq.output_ids += [3, 4, 5]
    assert seq.weight_version == 5
    assert seq.version_spans() == [
        {"version": 3, "start": 0, "end": 2},
        {"version": 5, "start": 2, "end": 5},
    ]
