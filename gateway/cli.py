"""`sluice` command line: serve, keys create|list|revoke (worker and bench arrive with later issues).

OMP_WAIT_POLICY is set before anything imports torch: on a small shared CPU box torch's OpenMP
threads otherwise busy-wait between kernels and slow everything down by orders of magnitude.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

log = logging.getLogger("sluice")


def _settings(args: argparse.Namespace, **overrides: Any):
    from gateway.config import load_settings

    return load_settings(getattr(args, "config", None), **overrides)


# ---------------------------------------------------------------- serve


async def _serve(settings, engine: Any = None) -> None:
    from aiohttp import web

    from gateway.app import STATE, create_app
    from gateway.auth import check_bind_allowed
    from gateway.keys import KeyStore

    keys = KeyStore(settings.auth.keys_file)
    auth_mode = check_bind_allowed(settings.server.host, keys)
    if not keys.has_keys():
        log.warning("no API keys in %s: serving WITHOUT authentication (loopback only); "
                    "create one with `sluice keys create`", keys.path)
    app = create_app(settings, engine=engine, keys=keys)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=settings.server.shutdown_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, settings.server.host, settings.server.port)
    await site.start()
    state = app[STATE]
    # Wait for the engine to give the one informative start line (capacity needs the engine).
    while state.worker is None and state.load_error is None:
        await asyncio.sleep(0.05)
    capacity = state.worker.capacity if state.worker else 0
    log.info("sluice serving on http://%s:%d model=%s max_model_len=%d capacity=%d running "
             "(+%s queued per tier) auth=%s", settings.server.host, settings.server.port, state.model_name,
             state.max_model_len, capacity, dict(settings.queue.max_depth), auth_mode)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.auth import InsecureBindError

    overrides: dict[str, Any] = {}
    server: dict[str, Any] = {}
    if args.host is not None:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if server:
        overrides["server"] = server
    if args.model is not None:
        overrides["model"] = {"path": args.model}
    settings = _settings(args, **overrides)
    try:
        asyncio.run(_serve(settings))
    except InsecureBindError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    return 0


# ---------------------------------------------------------------- keys


def _keystore(args: argparse.Namespace):
    from gateway.keys import KeyStore

    path = args.keys_file or _settings(args).auth.keys_file
    return KeyStore(path)


def cmd_keys_create(args: argparse.Namespace) -> int:
    from gateway.keys import KeyStoreError

    settings = _settings(args)
    if args.tier not in settings.tiers:
        print(f"sluice: unknown tier {args.tier!r}; configured: {', '.join(settings.tiers)}", file=sys.stderr)
        return 2
    store = _keystore(args)
    try:
        key = store.create(args.name, args.tier)
    except KeyStoreError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 1
    print(key)
    print(f"# key {args.name!r} (tier {args.tier}) stored in {store.path}; it is shown only this once.",
          file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    store = _keystore(args)
    rows = [("NAME", "TIER", "ID", "CREATED", "REVOKED")]
    for r in store.records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created))
        rows.append((r.name, r.tier, r.short_id, created, "yes" if r.revoked else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from gateway.keys import KeyStoreError

    store = _keystore(args)
    try:
        rec = store.revoke(args.name_or_id)
    except KeyStoreError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 1
    print(f"revoked {rec.name} ({rec.short_id})")
    return 0


def cmd_not_implemented(args: argparse.Namespace) -> int:
    print(f"sluice {args.command}: not implemented yet", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="OpenAI-compatible LLM gateway")
    p.add_argument("--log-level", default=os.environ.get("SLUICE_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP gateway with a local engine")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--model", help="model path (.gguf or HF folder); default: SmolLM2-135M-Instruct")
    serve.add_argument("--config", help="TOML config file (default: $SLUICE_CONFIG or config/sluice.toml)")
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    for name, func, help_ in (("create", cmd_keys_create, "create a key (printed once)"),
                              ("list", cmd_keys_list, "list keys (never shows them)"),
                              ("revoke", cmd_keys_revoke, "revoke a key by name or id")):
        kp = keys_sub.add_parser(name, help=help_)
        kp.add_argument("--config")
        kp.add_argument("--keys-file", help="default: auth.keys_file from the config")
        kp.set_defaults(func=func)
        if name == "create":
            kp.add_argument("--name", required=True)
            kp.add_argument("--tier", required=True)
        elif name == "revoke":
            kp.add_argument("name_or_id")

    for name in ("worker",):
        np_ = sub.add_parser(name, help="(not implemented yet)")
        np_.add_argument("rest", nargs=argparse.REMAINDER)
        np_.set_defaults(func=cmd_not_implemented)

    bench = sub.add_parser("bench", help="run a benchmark from bench/ (list them with `sluice bench`)")
    bench.add_argument("name", nargs="?", help="benchmark module, e.g. engine_batching")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    bench.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks live in the source tree's bench/ folder (they are not installed with the package)."""
    import importlib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "bench").is_dir():
        print("bench/ is not next to the gateway package: run `sluice bench` from a source checkout", file=sys.stderr)
        return 2
    available = sorted(p.stem for p in (root / "bench").glob("*.py")
                       if p.stem not in ("__init__", "common", "driver") and not p.stem.startswith("_"))
    if not args.name or args.name not in available:
        print("benchmarks: " + ", ".join(available), file=sys.stderr)
        return 0 if not args.name else 2
    sys.path.insert(0, str(root))
    importlib.import_module(f"bench.{args.name}").main(args.rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
