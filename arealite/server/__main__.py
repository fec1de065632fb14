"""`python -m arealite.server --model-path P --port N`: the embedded SGLang-compatible server.

Prints a line starting with READY_MARKER once it accepts connections, so launchers can wait on it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import socket
import sys

from arealite.lifecycle.fast_exit import run_then_exit_fast

READY_MARKER = "arealite server ready"
API_KEY_ENV = "AREAL_SERVER_API_KEY"  # how launchers hand the key to servers and trainers


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--model-path",
        required=True,
        help="HF causal LM or vision-language model directory (weights + tokenizer)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument(
        "--device", default=None, help="torch device (default: cuda if available, else cpu)"
    )
    g.add_argument("--seed", type=int, default=0, help="sampling RNG seed")
    g.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )


def _add_http_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    g.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' (not on /health); default ${API_KEY_ENV}",
    )
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")


def _add_engine_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-batch-size", type=int, default=64, help="most rows decoded together")
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="cap on padded prompt tokens prefilled in one step (bounds memory on long prompts)",
    )
    g.add_argument("--weight-version", type=int, default=0, help="version of the initial weights")
    g.add_argument(
        "--allowed-weight-roots",
        action="extend",
        nargs="+",
        default=[],
        metavar="DIR",
        help="update_weights_from_disk refuses paths outside these with 403 (repeatable; "
        "default: the --model-path folder; '/' allows any)",
    )
    g.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats lines")
    g.add_argument("--log-level", default="INFO")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The server's options, checked up front: a bad value fails here with a usage message,
    not later inside the scheduler, and a non-loopback bind without an API key is refused."""
    p = argparse.ArgumentParser(
        prog="python -m arealite.server", description=__doc__.splitlines()[0]
    )
    _add_model_args(p.add_argument_group("model"))
    _add_http_args(p.add_argument_group("HTTP"))
    _add_engine_args(p.add_argument_group("batching, weights and logging"))
    args = p.parse_args(argv)
    if args.max_batch_size < 1:
        p.error(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if not os.path.isdir(args.model_path):
        p.error(f"--model-path {args.model_path} is not a directory")
    if not args.api_key and not _is_loopback(args.host):
        p.error(
            f"--host {args.host} accepts connections from other machines, which could then "
            f"generate, load weights and pause the server: set --api-key (or ${API_KEY_ENV}), "
            "or bind 127.0.0.1"
        )
    return args


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it may resolve to anything
        return False


async def _serve(app, args, scheduler) -> None:
    from aiohttp import web

    access_log = logging.getLogger("aiohttp.access") if args.access_log else None
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its row.
    runner = web.AppRunner(app, access_log=access_log, handler_cancellation=True)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        msg = f"arealite server: cannot listen on {args.host}:{args.port}: {e.strerror}"
        raise SystemExit(msg) from None
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    print(f"{READY_MARKER}: http://{args.host}:{port} (model {args.model_path})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("arealite.server").info("shutting down")
    scheduler.shutdown()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from arealite.server.app import InferenceServer, ServerOptions
    from arealite.server.scheduler import Scheduler
    from arealite.server.vlm_runner import create_runner

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    runner = create_runner(args.model_path, dtype=args.dtype, device=args.device, seed=args.seed)
    logging.getLogger("arealite.server").info(
        "loaded %s on %s as %s (vocab %d, context %d)",
        args.model_path,
        runner.device,
        runner.dtype,
        runner.vocab_size,
        runner.max_positions,
    )
    scheduler = Scheduler(
        runner,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        weight_version=args.weight_version,
        log_interval=args.log_interval,
    )
    scheduler.start()
    options = ServerOptions(
        model_path=args.model_path,
        api_key=args.api_key,
        allowed_weight_roots=args.allowed_weight_roots,
        max_batch_size=args.max_batch_size,
    )
    app = InferenceServer(runner, scheduler, options).build_app()
    asyncio.run(_serve(app, args, scheduler))


if __name__ == "__main__":
    run_then_exit_fast(main)  # a stopped server skips ~1 s of interpreter teardown
