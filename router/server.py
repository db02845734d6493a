"""`shardlb serve`: run the router under uvicorn (uvloop, httptools), one cluster client per worker.

Usage: ``python -m router.server [serve] [--host H] [--port P] [--workers N]``. Flags override
SHARDLB_HOST / SHARDLB_PORT / SHARDLB_WORKERS; every other setting comes from the environment and is
checked before anything starts (exit status 2 naming the bad variable).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

import uvicorn
from redis.utils import HIREDIS_AVAILABLE
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from router import logs
from router.app import HIREDIS_WARNING
from router.settings import Settings, SettingsError, warnings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlb serve",
        description="Serve the shardlb HTTP API. Settings come from SHARDLB_* variables (router/README.md).",
    )
    parser.add_argument("--host", help="address to listen on (SHARDLB_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (SHARDLB_PORT, default 8000)")
    parser.add_argument("--workers", type=int, help="worker processes (SHARDLB_WORKERS, default 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the router until it is stopped; return the exit status (2: bad settings, 3: start failed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    options = build_parser().parse_args(args)
    # Workers are fresh processes that build their settings from the environment: put the flags there.
    for name, value in (
        ("SHARDLB_HOST", options.host),
        ("SHARDLB_PORT", options.port),
        ("SHARDLB_WORKERS", options.workers),
    ):
        if value is not None:
            os.environ[name] = str(value)
    try:
        settings = Settings.from_env()
    except SettingsError as e:
        print(f"shardlb serve: error: {e}", file=sys.stderr)
        return 2
    log = logs.configure(settings.log_level)  # this process's uvicorn lines too (the workers', create_app)
    for warning in warnings(settings, os.environ):
        log.warning(warning)
    if not HIREDIS_AVAILABLE:
        print(f"\n{'!' * 78}\nWARNING: {HIREDIS_WARNING}\n{'!' * 78}\n", file=sys.stderr)
    metrics_dir = None
    if settings.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = tempfile.mkdtemp(prefix="shardlb-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    # uvicorn drains on SIGTERM, then raises the signal again under the handler found at start. An
    # orderly drain is a clean exit: with this no-op the process returns 0 instead of dying by signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        return _serve(
            "router.app:create_app",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            loop="uvloop",
            http="router.http:HttpToolsProtocol",  # httptools, one socket write per response
            lifespan="on",
            access_log=False,  # the router's own JSON access lines, when SHARDLB_ACCESS_LOG is on
            # uvicorn would take X-Forwarded-For from 127.0.0.1 (or FORWARDED_ALLOW_IPS) and rewrite
            # the peer; the app does that itself, only for SHARDLB_TRUSTED_PROXIES.
            proxy_headers=False,
            log_level=settings.log_level,
            log_config=None,  # uvicorn's would put its plain-text handler back: router/logs.py's JSON
            server_header=False,
            timeout_graceful_shutdown=math.ceil(settings.drain_seconds),
        )
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _serve(app: str, **options: Any) -> int:
    """Run uvicorn; 0 after an orderly stop, STARTUP_FAILURE (3) when the app could not start.

    One worker is uvicorn.run's own (it exits 3 itself). With more, uvicorn's parent stops when a
    worker fails to start but returns as after a SIGTERM, so a supervisor (systemd's
    Restart=on-failure, a pod's restart policy) would see a clean exit: the parent is run here, as
    uvicorn.run runs it, and asked afterwards how its workers ended."""
    config = uvicorn.Config(app, **options)
    if config.workers <= 1:
        uvicorn.run(app, **options)
        return 0
    supervisor = Multiprocess(config, sockets=[config.bind_socket()])
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C is an orderly stop
        supervisor.run()
    return STARTUP_FAILURE if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes) else 0


if __name__ == "__main__":
    sys.exit(main())
