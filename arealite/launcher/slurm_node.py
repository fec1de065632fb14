"""What runs on a Slurm node for the Slurm launcher (`slurm.py`): `register-and-run` starts an
inference server on a free port of this node, waits for its health, registers `host:port` in
name_resolve (with a keepalive TTL, so a dead server's entry disappears) and lives as long as
the server.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import socket
import subprocess

from arealite.api.cli_args import NameResolveConfig
from arealite.launcher.name_resolve import make_repository
from arealite.launcher.servers import wait_healthy
from arealite.launcher.slurm_scripts import HOST, PORT
from arealite.lifecycle.lifeline import die_with_parent, watch_parent
from arealite.utils.network import find_free_port

__all__ = ["node_address", "register_and_run", "SERVER_KEEPALIVE_TTL"]

SERVER_KEEPALIVE_TTL = 30.0


def node_address() -> str:
    """This node's address as other nodes reach it: the source address of its default route
    (a UDP connect sends nothing), else what its hostname resolves to (Debian maps the
    hostname to 127.0.1.1, hence not first)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    return socket.gethostbyname(socket.gethostname())


def register_and_run(argv: list[str]) -> int:
    """Run a server command on this node: fill in host/port, wait for health, register the
    address in name_resolve, then live as long as the server (forwarding SIGTERM to it)."""
    p = argparse.ArgumentParser(prog="python -m arealite.launcher.slurm register-and-run")
    p.add_argument("--key", required=True)
    p.add_argument("--name-resolve-type", default="nfs")
    p.add_argument("--name-resolve-root", default="")
    p.add_argument("--host", default="auto", help="bind address; auto = this node's address")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("missing the server command after --")
    host = node_address() if args.host == "auto" else args.host
    port = find_free_port(host)
    cmd = [a.replace(HOST, host).replace(PORT, str(port)) for a in cmd]
    address = f"{host}:{port}"
    print(f"[register-and-run] starting {shlex.join(cmd)}", flush=True)
    child = subprocess.Popen(cmd, preexec_fn=die_with_parent)
    watch_parent()  # the launcher's heartbeat: a killed launcher ends this server too

    def forward(signum, frame):
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if not wait_healthy(address, args.timeout, lambda: child.poll() is None):
        why = f"exited with code {child.returncode}" if child.poll() is not None else "timed out"
        print(
            f"[register-and-run] server at {address} failed before becoming healthy ({why})",
            flush=True,
        )
        child.kill()
        child.wait()
        return 1
    nr_config = NameResolveConfig(
        type=args.name_resolve_type, nfs_record_root=args.name_resolve_root
    )
    repo = make_repository(nr_config, "")
    repo.add(
        args.key, address, replace=True, delete_on_exit=True, keepalive_ttl=SERVER_KEEPALIVE_TTL
    )
    print(f"[register-and-run] {address} healthy, registered as {args.key}", flush=True)
    rc = child.wait()
    print(f"[register-and-run] server exited with code {rc}", flush=True)
    return rc
