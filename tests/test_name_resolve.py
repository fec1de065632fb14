"""Name resolve: the same contract on the shared-filesystem and the Ray backend."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from arealite.api.cli_args import ConfigError, NameResolveConfig
from arealite.launcher import name_resolve as nr


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray instance for this module (stopped by ray.shutdown, which we started)."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'ray[default]')")
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ctx = ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ctx.address_info["address"]
    ray.shutdown()


@pytest.fixture(params=["nfs", pytest.param("ray", marks=pytest.mark.integration)])
def repo(request, tmp_path):
    if request.param == "nfs":
        r = nr.FileNameResolveRepository(str(tmp_path / "nr"))
    else:
        request.getfixturevalue("ray_address")
        r = nr.RayNameResolveRepository()
        r.clear_subtree("t")
    yield r
    r.reset()
    r.clear_subtree("t")


def test_add_get_replace_delete(repo):
    repo.add("t/a", "1")
    assert repo.get("t/a") == "1"
    with pytest.raises(nr.NameEntryExistsError, match="t/a"):
        repo.add("t/a", "2")
    repo.add("t/a", "2", replace=True)
    assert repo.get("t/a") == "2"
    repo.delete("t/a")
    with pytest.raises(nr.NameEntryNotFoundError, match="t/a"):
        repo.get("t/a")
    with pytest.raises(nr.NameEntryNotFoundError):
        repo.delete("t/a")


def test_subtree_in_key_order_and_clear(repo):
    for i in (10, 2, 0):
        repo.add(nr.server_key("exp", "t", i), f"host:{i}")
    repo.add("exp/t/meta", "m")
    repo.add("exp/other/servers/00000", "elsewhere")
    assert repo.get_subtree(nr.servers_root("exp", "t")) == ["host:0", "host:2", "host:10"]
    assert repo.find_subtree("exp/t") == [
        "exp/t/meta",
        "exp/t/servers/00000",
        "exp/t/servers/00002",
        "exp/t/servers/00010",
    ]
    repo.clear_subtree(nr.trial_root("exp", "t"))
    assert repo.get_subtree("exp/t") == []
    assert repo.get("exp/other/servers/00000") == "elsewhere"  # other trials untouched
    repo.clear_subtree("exp")


def test_wait_sees_a_later_add_and_times_out_naming_the_key(repo):
    threading.Timer(0.3, lambda: repo.add("t/late", "v")).start()
    assert repo.wait("t/late", timeout=10, poll=0.05) == "v"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="t/never"):
        repo.wait("t/never", timeout=0.3, poll=0.05)
    assert time.monotonic() - t0 < 3


def test_keepalive_entry_lives_while_refreshed_then_expires(repo):
    repo.add("t/alive", "v", keepalive_ttl=0.6)
    time.sleep(1.5)  # > 2 TTLs: only the refresher keeps it alive
    assert repo.get("t/alive") == "v"
    repo._stop.set()  # the owner stops refreshing (as if it crashed)
    repo._thread.join(timeout=5)
    time.sleep(1.0)
    with pytest.raises(nr.NameEntryNotFoundError):
        repo.get("t/alive")
    repo.add("t/alive", "new")  # an expired entry does not block a fresh add


def test_bad_keys_and_values_are_named(repo):
    for bad in ("", "/abs", "a//b", "a/../b", "a b"):
        with pytest.raises(ValueError, match="bad name_resolve key"):
            repo.add(bad, "v")
    with pytest.raises(TypeError, match="strings"):
        repo.add("t/x", 3)


def test_concurrent_adders_exactly_one_wins(tmp_path):
    root = str(tmp_path / "nr")
    code = (
        "import sys; from arealite.launcher.name_resolve import *\n"
        "r = FileNameResolveRepository(sys.argv[1])\n"
        "try:\n    r.add('t/lock', sys.argv[2]); print('won')\n"
        "except NameEntryExistsError:\n    print('lost')\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, root, str(i)], stdout=subprocess.PIPE)
        for i in range(4)
    ]
    outs = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
    assert sorted(outs) == ["lost", "lost", "lost", "won"]
    winner = outs.index("won")
    assert nr.FileNameResolveRepository(root).get("t/lock") == str(winner)


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)


@pytest.mark.integration  # a multi-second run: not in `make test-fast`
def test_other_process_entries_delete_on_exit_and_expire_after_kill(tmp_path):
    root = str(tmp_path / "nr")
    repo = nr.FileNameResolveRepository(root)
    code = (
        "import sys, time; from arealite.launcher.name_resolve import *\n"
        "r = FileNameResolveRepository(sys.argv[1])\n"
        "r.add('t/on_exit', 'a', delete_on_exit=True)\n"
        "r.add('t/ttl', 'b', keepalive_ttl=0.6)\n"
        "print('added', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
    )
    p = _child(code, root, "0")
    p.communicate(timeout=60)
    assert repo.get_subtree("t") == ["b"]  # on_exit removed at exit; ttl entry still fresh
    time.sleep(1.0)
    assert repo.get_subtree("t") == []  # nobody refreshes it any more
    p = _child(code, root, "60")
    assert p.stdout.readline().strip() == "added"
    time.sleep(1.5)
    assert repo.get_subtree("t") == ["a", "b"]  # refreshed by the live child
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(1.0)
    assert repo.get_subtree("t") == ["a"]  # killed: no atexit, but the TTL entry expired


@pytest.mark.integration
def test_ray_entries_are_shared_across_processes(ray_address):
    repo = nr.RayNameResolveRepository()
    repo.clear_subtree("x")
    code = (
        "import sys; from arealite.launcher.name_resolve import RayNameResolveRepository as R\n"
        "r = R(address=sys.argv[1]); r.add('x/from_child', 'hello')\n"
        "print(r.get('x/from_parent'))\n"
    )
    repo.add("x/from_parent", "hi")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run(
        [sys.executable, "-c", code, ray_address],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "hi"
    assert repo.get("x/from_child") == "hello"
    repo.clear_subtree("x")


def test_make_repository(tmp_path):
    r = nr.make_repository(NameResolveConfig(), str(tmp_path))
    assert isinstance(r, nr.FileNameResolveRepository)
    assert r.root == str(tmp_path / "name_resolve")
    custom = nr.make_repository(NameResolveConfig(nfs_record_root=str(tmp_path / "c")), "unused")
    assert custom.root == str(tmp_path / "c")
    with pytest.raises(
        ConfigError, match=r"type='etcd' is not allowed; choose one of \['nfs', 'ray'\]"
    ):
        NameResolveConfig(type="etcd")  # no etcd backend: refused by the config, not later
