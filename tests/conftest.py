"""Shared fixtures: tiny offline models are built once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    # pytest-xdist workers share the cores: each worker's own compute (and the processes its
    # tests start without thread settings of their own) gets its share, and idle OpenMP pools
    # sleep instead of spinning on the cores the other worker needs (as the launcher's
    # cpu_threads: shared). Set before anything imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The longest modules, longest first (seconds in `make test`, 2026-11-27 night, 2-core EPYC):
# recover 140, chaos 122, launcher_ray 83, launcher_slurm 76, lora 74, tensor_parallel 71, byot
# 52, vllm_remote 48. Order only: a stale entry costs balance between pytest-xdist workers,
# never a result.
LONGEST_FIRST = (
    "test_recover",
    "test_chaos",
    "test_launcher_ray",
    "test_launcher_slurm",
    "test_lora",
    "test_tensor_parallel",
    "test_byot",
    "test_vllm_remote",
)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (stable within a module and among the rest): with
    `--dist loadfile` the two workers start on the long files, so the run does not end on one
    worker's long tail while the other idles."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))


def run_temp_root(tmp_path_factory):
    """The folder that holds every test's files in this run: the session temp dir, or under
    pytest-xdist the run's dir above the workers' (where `built_once` puts shared models). A
    server's `--allowed-weight-roots` for test weights."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def weight_roots(tmp_path_factory) -> list[str]:
    """Server arguments that let it load any weights the tests wrote."""
    return ["--allowed-weight-roots", str(run_temp_root(tmp_path_factory))]


def built_once(tmp_path_factory, name: str, build) -> str:
    """`build(out_dir) -> path` run once per test run, also under pytest-xdist: the first worker
    builds into the run's temp root (under a file lock) and the others reuse it, as xdist's
    documentation recommends for session data. The result is read-only for tests."""
    from filelock import FileLock

    shared = run_temp_root(tmp_path_factory)
    done = shared / f"{name}.path"  # holds what `build` returned
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            (shared / name).mkdir(exist_ok=True)
            done.write_text(build(str(shared / name)))
    return done.read_text()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random ~3M-parameter Qwen2 + tokenizer on disk, loadable with from_pretrained(path)."""
    from arealite.testing.tiny_model import build_tiny_model

    return built_once(tmp_path_factory, "tiny_model", build_tiny_model)


@pytest.fixture(scope="session")
def tiny_model_dir_v2(tmp_path_factory) -> str:
    """Same architecture and tokenizer, different random weights (for weight-update tests)."""
    from arealite.testing.tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model_v2")), seed=2)


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model taught one add-tool round trip (tests/_agent_models.py; ~15 s to teach),
    shared read-only by the OpenAI-API and agent client tests (and their xdist workers)."""
    from _agent_models import build_tool_model

    def build(out_dir: str) -> str:
        return build_tool_model(tiny_model_dir, os.path.join(out_dir, "model"))

    return built_once(tmp_path_factory, "tool", build)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> str:
    """A random ~0.7M-parameter Qwen2-VL + processor files (see arealite/utils/tiny_vlm.py)."""
    from arealite.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")))


@pytest.fixture(scope="session")
def tiny_vlm_dir_v2(tmp_path_factory) -> str:
    """Same VLM architecture and processor, different random weights."""
    from arealite.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm_v2")), seed=2)


@pytest.fixture
def build_engine():
    """`build_engine(cls, config, ft_spec=None)`: an initialised train engine (1 process),
    destroyed when the test ends, so a failing test never leaks its process group."""
    engines = []

    def build(cls, config, ft_spec=None):
        engine = cls(config)
        engine.initialize(None, ft_spec)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.destroy()


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """One embedded server on the tiny model (fp32, one thread) shared by the tests that only
    generate through it: none of them pauses it, aborts on it or loads weights into it."""
    from arealite.server.process import launch_server

    with launch_server(tiny_model_dir, env={"OMP_NUM_THREADS": "1"}, dtype="float32") as server:
        yield server


@pytest.fixture
def tiny_executor(tiny_server):
    """A fresh workflow executor (consumer batch 64, its own counters) on a client of the shared
    tiny server."""
    from _rollout import rollout_executor

    with rollout_executor(tiny_server.address, consumer_batch_size=64) as executor:
        yield executor
