"""Inference clients: talk to generation servers (SGLang, vLLM, our embedded server) over HTTP,
route requests across a pool, and push trainer weights to them. Imports arealite.api,
arealite.utils and arealite.lifecycle (the fencing token) only; the training engines live in
arealite.engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arealite.api.cli_args import RolloutConfig
    from arealite.inference.remote_base import RemoteInferenceEngine


def make_remote_engine(backend: str, config: RolloutConfig) -> RemoteInferenceEngine:
    """The inference client for an allocation mode's backend: vLLM, or SGLang's protocol
    (spoken by real SGLang servers and by our embedded server alike)."""
    if backend == "vllm":
        from arealite.inference.vllm_remote import RemoteVLLMEngine

        return RemoteVLLMEngine(config)
    if backend in ("sglang", "local"):
        from arealite.inference.sglang_remote import RemoteSGLangEngine

        return RemoteSGLangEngine(config)
    raise ValueError(f"unknown inference backend {backend!r}; use sglang, vllm or local")
