"""Rollout clients on a running server, closed when the block ends (fixtures yield from these)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from arealite.api.cli_args import RolloutConfig
from arealite.inference.sglang_remote import RemoteSGLangEngine
from arealite.rollout import WorkflowExecutor


@contextmanager
def remote_engine(address: str, engine_cls=RemoteSGLangEngine, **config) -> Iterator:
    """An initialised client of the server at `address` (RolloutConfig fields in `config`)."""
    engine = engine_cls(RolloutConfig(**config))
    engine.initialize([address])
    try:
        yield engine
    finally:
        engine.destroy()


@contextmanager
def rollout_executor(address: str, **config) -> Iterator[WorkflowExecutor]:
    """A workflow executor on its own client of the server at `address`."""
    with remote_engine(address, **config) as engine:
        executor = WorkflowExecutor(engine.config, engine)
        executor.initialize()
        try:
            yield executor
        finally:
            executor.destroy()
