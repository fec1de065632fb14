"""The embedded server never dies on bad input: 1,000 malformed requests (random JSON, wrong
types, huge numbers, bad UTF-8, deep nesting, wrong methods) each get a 4xx with a JSON error,
and a valid request still succeeds afterwards. Also: a non-loopback bind needs an API key."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import requests

from arealite.server.process import launch_server

pytestmark = pytest.mark.integration

N_REQUESTS = 1000


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    roots = str(tmp_path_factory.mktemp("allowed_weights"))  # empty: no path can be loaded
    s = launch_server(tiny_model_dir, dtype="float32", extra_args=["--allowed-weight-roots", roots])
    yield s
    s.stop()


# ----------------------------------------------------------------------------- generators


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64, 10**30, rng.randrange(-1000, 1000)])
    if kind == 2:
        return rng.choice([0.5, -1e308, 1e308, 1.5, float("nan"), float("inf"), -0.0])
    if kind == 3:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 4:
        return rng.choice(["", "abort", "input_ids", "1", "null"])
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(random_json(rng, 3)): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def wrong(rng: random.Random, good_kind: type):
    """A random JSON value that is not of `good_kind`."""
    while True:
        v = random_json(rng)
        if not isinstance(v, good_kind) or isinstance(v, bool) != (good_kind is bool):
            return v


BAD_SAMPLING = [
    ("temperature", [-1, "hot", [], {}, True, 1e400, float("nan")]),
    ("top_p", [0, 1.5, -0.1, "x", 1e400]),
    ("top_k", [-2, 1.5, "k", []]),
    ("max_new_tokens", [-1, 10**12, "10", 1.5, 2**70, 1e400]),
    ("min_new_tokens", [-1, 10**9, "3", 0.5]),
    ("stop_token_ids", ["2", [-1], [10**9], [[1]], {"a": 1}, [1.5]]),
    ("ignore_eos", ["yes", 1, []]),
    ("sampling_seed", [-1, 2**64, "7", 1.5, [], True]),
    ("n", [2, 0]),
    ("regex", ["a+"]),
    ("frequency_penalty", [0.5]),
    ("no_such_param", [1]),
]
BAD_TOP = [
    ("rid", [123, "", [], {}]),
    ("return_logprob", ["true", 1]),
    ("stream", [True]),
    ("no_such_field", [1]),
    ("sampling_params", [[], "greedy", 3]),
]


def bad_generate(rng: random.Random) -> bytes | str | dict | list:
    valid = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    kind = rng.randrange(9)
    if kind == 0:  # bad UTF-8
        text = json.dumps(valid).encode()
        cut = rng.randrange(len(text))
        return (
            text[:cut] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"]) + text[cut:]
        )
    if kind == 1:  # not JSON / truncated JSON
        text = json.dumps(valid)
        return rng.choice([text[: rng.randrange(1, len(text) - 1)], "{'a': 1}", "", " ", "[1,]"])
    if kind == 2:  # JSON, but not an object
        return json.dumps(rng.choice([random_json(rng), [valid], None, 3, "x"]))
    if kind == 3:  # an object without input_ids
        body = {str(random_json(rng, 3)): random_json(rng, 1) for _ in range(rng.randrange(4))}
        body.pop("input_ids", None)
        body["text"] = "hello"
        return body
    if kind == 4:  # input_ids of the wrong kind
        ids = rng.choice(
            [
                "5 6 7",
                {"a": 1},
                5,
                [],
                [5, "6"],
                [5.5],
                [-1],
                [10**9],
                [2**70],
                [True, False],
                [None],
                [[5, "6"]],
                [[5], []],
                [[5], 6],
                [5, [6]],  # bad batches
            ]
        )
        return {**valid, "input_ids": ids}
    if kind == 5:  # one sampling parameter wrong
        key, values = rng.choice(BAD_SAMPLING)
        return {**valid, "sampling_params": {"max_new_tokens": 2, key: rng.choice(values)}}
    if kind == 6:  # one top-level field wrong
        key, values = rng.choice(BAD_TOP)
        return {**valid, key: rng.choice(values)}
    if kind == 7:  # prompt + budget beyond the context, min above max
        return rng.choice(
            [
                {"input_ids": [5] * 10**5},
                {**valid, "sampling_params": {"max_new_tokens": 10**7}},
                {**valid, "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
            ]
        )
    depth = rng.choice([10**3, 10**5])  # nesting deeper than any parser's recursion limit
    return "[" * depth + "]" * depth


def bad_other(rng: random.Random) -> tuple[str, str, bytes | str | dict | list]:
    """(method, path, body) for the other endpoints, always malformed."""
    kind = rng.randrange(7)
    if kind == 0:
        body = rng.choice(
            [
                {},
                {"model_path": wrong(rng, str)},
                {"model_path": "/etc"},
                {"model_path": "/no/such/dir", "weight_version": 1},
                {"model_path": "/tmp", "weight_version": rng.choice(["abc", 1.5, [], {}])},
            ]
        )
        return "POST", "/update_weights_from_disk", body
    if kind == 1:
        return "POST", "/abort_request", {"rid": wrong(rng, str), "abort_all": False}
    if kind == 2:
        return "POST", "/pause_generation", {"mode": rng.choice(["keep", "retract", 1, []])}
    if kind == 3:
        body = rng.choice([[], "x", {"master_address": wrong(rng, str), "master_port": 1234}])
        return "POST", "/init_weights_update_group", body
    if kind == 4:
        body = rng.choice([{}, {"names": wrong(rng, list)}, {"names": ["a"], "dtypes": "x"}])
        return "POST", "/update_weights_from_distributed", body
    if kind == 5:
        return rng.choice([("GET", "/generate"), ("PUT", "/health"), ("DELETE", "/generate")]) + (
            b"",
        )
    return "POST", rng.choice(["/no_such_endpoint", "/generate/", "/../etc/passwd"]), {}


def encode(body) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body).encode()  # NaN / Infinity literals included, as Python sends them


# ----------------------------------------------------------------------------- tests


def test_a_thousand_malformed_requests_get_4xx_and_the_server_keeps_serving(server):
    rng = random.Random(1234)
    session = requests.Session()
    session.trust_env = False  # straight to 127.0.0.1, never through a proxy
    statuses = {}
    for i in range(N_REQUESTS):
        if i % 3:
            method, path, body = "POST", "/generate", bad_generate(rng)
        else:
            method, path, body = bad_other(rng)
        r = session.request(method, server.url + path, data=encode(body), timeout=60)
        assert 400 <= r.status_code < 500, (
            f"request {i}: {method} {path} {encode(body)[:200]!r} -> {r.status_code} {r.text[:300]}"
        )
        assert r.json().get("error"), r.text[:200]  # a JSON error naming the problem
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert statuses.get(400, 0) > N_REQUESTS // 2, statuses

    assert session.get(server.url + "/health", timeout=10).status_code == 200
    good = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True,
    }
    r = session.post(server.url + "/generate", json=good, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 3
    assert server.alive()
    assert "unhandled error" not in server.log_tail(10**6)


def test_a_non_loopback_bind_needs_an_api_key(tiny_model_dir):
    cmd = [
        sys.executable,
        "-m",
        "arealite.server",
        "--model-path",
        tiny_model_dir,
        "--host",
        "0.0.0.0",
        "--port",
        "0",
    ]
    env = {k: v for k, v in os.environ.items() if k != "AREAL_SERVER_API_KEY"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0
    assert "--api-key" in p.stderr and "0.0.0.0" in p.stderr
