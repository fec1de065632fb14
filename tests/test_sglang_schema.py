"""SGLang's request models as the contract (arealite/server/sglang_schema.py): the embedded
server refuses what current SGLang refuses (no body, a missing required field, a wrong type)
with a 400 naming it, keeps serving, and our client sends what SGLang expects."""

from __future__ import annotations

import pytest
import requests

from arealite.api.cli_args import RolloutConfig
from arealite.inference.sglang_remote import RemoteSGLangEngine
from arealite.server.protocol import BadRequest
from arealite.server.sglang_schema import MODELS, parse_body


@pytest.mark.parametrize("route", sorted(MODELS))
def test_no_body_is_refused_on_every_modelled_route(route):
    with pytest.raises(BadRequest, match=f"body: required; /{route} takes a JSON object"):
        parse_body(route, b"")
    with pytest.raises(BadRequest, match="expected a JSON object, got list"):
        parse_body(route, b"[]")


@pytest.mark.parametrize(
    "route,body,needle",
    [
        ("update_weights_from_disk", b"{}", "model_path: required field is missing"),
        ("update_weights_from_disk", b'{"model_path": null}', "model_path: required"),
        (
            "init_weights_update_group",
            b'{"master_address": "h", "master_port": 1, "rank_offset": 1}',
            "world_size: required",
        ),
        (
            "init_weights_update_group",
            b'{"master_address": "h", "master_port": "x", "rank_offset": 1, "world_size": 2}',
            "master_port: expected an integer",
        ),
        (
            "update_weights_from_distributed",
            b'{"names": ["a"], "dtypes": ["float32"]}',
            "shapes: required",
        ),
        (
            "update_weights_from_distributed",
            b'{"names": ["a"], "dtypes": ["f"], "shapes": [[1, "2"]]}',
            "shapes: expected a list of lists of integers",
        ),
        ("continue_generation", b'{"torch_empty_cache": 1}', "torch_empty_cache: expected true"),
        ("abort_request", b'{"abort_all": "yes"}', "abort_all: expected true or false"),
        ("pause_generation", b'{"mode": 3}', "mode: expected a string"),
    ],
)
def test_required_fields_and_types_follow_sglang(route, body, needle):
    with pytest.raises(BadRequest, match=needle):
        parse_body(route, body)


def test_minimal_and_unknown_fields_pass_as_in_sglang():
    assert parse_body("pause_generation", b"{}") == {}
    assert parse_body("continue_generation", b'{"torch_empty_cache": false, "x": 1}')["x"] == 1
    assert parse_body("update_weights_from_disk", b'{"model_path": "/m", "weight_version": "3"}')


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from arealite.server.process import launch_server

    with launch_server(tiny_model_dir, dtype="float32") as s:
        yield s
        assert s.alive(), s.log_tail()


@pytest.mark.integration
def test_the_server_answers_400_naming_the_missing_body_and_keeps_serving(server):
    for route in sorted(MODELS):
        r = requests.post(f"{server.url}/{route}", timeout=30)
        assert r.status_code == 400, (route, r.text)
        assert f"/{route} takes a JSON object" in r.json()["error"]
    r = requests.post(f"{server.url}/pause_generation", json={"mode": "retract"}, timeout=30)
    assert r.status_code == 400 and "'retract' is not supported" in r.json()["error"]
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.mark.integration
def test_the_client_pauses_and_continues_with_sglangs_bodies(server):
    engine = RemoteSGLangEngine(RolloutConfig(consumer_batch_size=1, setup_timeout=60))
    engine.initialize([server.url.removeprefix("http://")])
    try:
        engine.pause_generation()
        info = requests.get(f"{server.url}/get_model_info", timeout=30).json()
        assert info["paused"] is True
        engine.continue_generation()
        info = requests.get(f"{server.url}/get_model_info", timeout=30).json()
        assert info["paused"] is False
    finally:
        engine.destroy()
