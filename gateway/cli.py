"""`sluice` command line: serve [--no-engine], worker, keys create|list|revoke, usage, bench (the loadgen package).

OpenMP is configured before anything imports torch (gateway/omp.py says why).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gateway.omp  # noqa: F401  (OpenMP settings, before anything imports torch)

if TYPE_CHECKING:
    from gateway.settings import Settings

log = logging.getLogger("sluice")


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    from gateway.settings import load_settings

    return load_settings(getattr(args, "config", None), **overrides)


# ---------------------------------------------------------------- serve


async def _serve(settings: Settings, no_engine: bool = False) -> None:
    from gateway.http.server import run_server

    await run_server(settings, _stop_event(), no_engine=no_engine)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    return stop


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.admission.auth import InsecureBindError
    from gateway.admission.keys import KeyStoreError
    from gateway.admission.ledger import LedgerError

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
    if args.redis_url is not None:
        overrides["redis_url"] = args.redis_url
    settings = _settings(args, **overrides)
    if args.no_engine and not settings.redis_url and not settings.engines:
        print("sluice serve --no-engine needs a Redis queue (--redis-url or SLUICE_REDIS_URL) or engine replicas "
              "([[engines]] in the config)", file=sys.stderr)
        return 2
    from gateway.http.server import loop_factory

    try:
        factory = loop_factory(settings.server.event_loop)
    except RuntimeError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_serve(settings, no_engine=args.no_engine))
    except InsecureBindError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    except KeyStoreError as e:
        print(f"sluice: {e}; refusing to start (fix or restore the keys file; remove it only to serve "
              "without keys on loopback)", file=sys.stderr)
        return 2
    except LedgerError as e:
        print(f"sluice: {e}; refusing to start: spend could not be recorded (free space or fix the folder, or "
              "set usage.ledger_path)", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- worker


async def _worker(settings: Settings, model: str | None) -> None:
    from gateway.worker.main import run_worker

    await run_worker(settings, _stop_event(), model=model)


def cmd_worker(args: argparse.Namespace) -> int:
    """`--model` names a configured model (its id or an alias): the worker serves that model's queue.
    Anything else is a chat model's path (.gguf or folder), served as the first chat model."""
    overrides: dict[str, Any] = {}
    if args.redis_url is not None:
        overrides["redis_url"] = args.redis_url
    settings = _settings(args, **overrides)
    model = args.model
    if model is not None and not any(model == e.id or model in e.aliases for e in settings.model_entries()):
        settings = _settings(args, model={"path": model}, **overrides)
        model = None
    if not settings.redis_url:
        print("sluice worker needs the Redis queue: --redis-url or SLUICE_REDIS_URL", file=sys.stderr)
        return 2
    asyncio.run(_worker(settings, model))
    return 0


# ---------------------------------------------------------------- keys


def _keystore(args: argparse.Namespace):
    from gateway.admission.keys import KeyStore

    path = args.keys_file or _settings(args).auth.keys_file
    return KeyStore(path, strict=True)


def cmd_keys_create(args: argparse.Namespace) -> int:
    from gateway.admission.keys import KeyStoreError

    settings = _settings(args)
    tier = args.tier
    if tier is None:
        if not args.admin:
            print("sluice: --tier is required (only an --admin key may leave it out)", file=sys.stderr)
            return 2
        tier = max(settings.tiers, key=lambda t: settings.tiers[t].priority)  # the lowest priority
    if tier not in settings.tiers:
        print(f"sluice: unknown tier {tier!r}; configured: {', '.join(settings.tiers)}", file=sys.stderr)
        return 2
    try:
        store = _keystore(args)
        key = store.create(args.name, tier, admin=args.admin)
    except KeyStoreError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 1
    print(key)
    role = ", admin: may read /metrics" if args.admin else ""
    print(f"# key {args.name!r} (tier {tier}{role}) stored in {store.path}; it is shown only this once.",
          file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from gateway.admission.keys import KeyStoreError

    try:
        store = _keystore(args)
    except KeyStoreError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 1
    rows = [("NAME", "TIER", "ID", "CREATED", "REVOKED", "ADMIN")]
    for r in store.records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created))
        rows.append((r.name, r.tier, r.short_id, created, "yes" if r.revoked else "no", "yes" if r.admin else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from gateway.admission.keys import KeyStoreError

    try:
        store = _keystore(args)
        rec = store.revoke(args.name_or_id)
    except KeyStoreError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 1
    print(f"revoked {rec.name} ({rec.short_id})")
    return 0


# ---------------------------------------------------------------- usage


def parse_since(text: str, now: float | None = None) -> float:
    """`24h`, `30m`, `7d`, `2w`, `90s` before now, or `all`: the earliest timestamp to report."""
    now = time.time() if now is None else now
    if text == "all":
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    try:
        return now - float(text[:-1]) * units[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise ValueError(f"--since {text!r}: a number and a unit (s, m, h, d, w), e.g. 24h; or 'all'") from None


def cmd_usage(args: argparse.Namespace) -> int:
    """Spend, its remote equivalent and the savings per key, model, backend or tier, from the usage ledger."""
    import csv

    from gateway.admission.ledger import group_report, read_redis, read_sqlite

    try:
        since = parse_since(args.since)
    except ValueError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    settings = _settings(args)
    redis_url = args.redis_url
    if redis_url is None and args.ledger is None:
        redis_url = settings.limits.redis_url or settings.redis_url
    try:
        if redis_url:
            rows = list(read_redis(redis_url, since))
        else:
            path = args.ledger or settings.ledger_path() or str(Path(settings.auth.keys_file).parent / "usage.sqlite3")
            rows = list(read_sqlite(path, since))
    except Exception as e:
        print(f"sluice: cannot read the usage ledger: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    report = group_report(rows, args.by)
    cols = [args.by, "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "spend", "equivalent",
            "savings"]
    if args.csv:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(cols)
        for g in report:
            w.writerow([g[c] if c not in ("spend", "equivalent", "savings") else f"{g[c]:.6f}" for c in cols])
        return 0
    total = {c: sum(g[c] for g in report) for c in cols[1:]}
    table = [[c.upper() for c in cols]]
    for g in [*report, {args.by: "TOTAL", **total}]:
        table.append([str(g[cols[0]]), *(str(g[c]) for c in cols[1:5]),
                      *(f"{g[c]:.4f}" for c in cols[5:])])
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    for r in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="OpenAI-compatible LLM gateway")
    p.add_argument("--log-level", default=os.environ.get("SLUICE_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP gateway (with a local engine unless --no-engine)")
    serve.add_argument("--no-engine", action="store_true",
                       help="gateway only: `sluice worker` processes run the engine (the Redis queue), or the "
                            "[[engines]] replicas serve alone")
    serve.add_argument("--redis-url", help="use the Redis queue (default: $SLUICE_REDIS_URL; unset: in-process)")
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
            kp.add_argument("--tier", help="required, except for --admin keys (default: the lowest tier)")
            kp.add_argument("--admin", action="store_true",
                            help="an admin key: may read /metrics, which needs one once any key exists")
        elif name == "revoke":
            kp.add_argument("name_or_id")

    usage = sub.add_parser("usage", help="spend, remote-equivalent cost and savings from the usage ledger")
    usage.add_argument("--since", default="24h", help="how far back: 30m, 24h, 7d, 2w, or all (default 24h)")
    usage.add_argument("--by", choices=("key", "model", "backend", "tier", "batch"), default="key",
                       help="group rows by this (batch: Batch API lines apart from online requests)")
    usage.add_argument("--csv", action="store_true", help="CSV on stdout (money to 6 decimals), no total row")
    usage.add_argument("--redis-url", help="read the Redis stream (default: limits.redis_url, else redis_url)")
    usage.add_argument("--ledger", help="the SQLite ledger file (default: usage.ledger_path from the config)")
    usage.add_argument("--config", help="TOML config file (default: $SLUICE_CONFIG or config/sluice.toml)")
    usage.set_defaults(func=cmd_usage)

    worker = sub.add_parser("worker", help="run an engine that drains the Redis queue (one per GPU)")
    worker.add_argument("--redis-url", help="default: $SLUICE_REDIS_URL")
    worker.add_argument("--model", help="a configured model's id or alias (its queue), or a chat model's path "
                        "(.gguf or HF folder); default: the first chat model")
    worker.add_argument("--config", help="TOML config file (default: $SLUICE_CONFIG or config/sluice.toml)")
    worker.set_defaults(func=cmd_worker)

    batch = sub.add_parser("batch", help="run a JSONL file through /v1/batches: submit, watch, download")
    batch.add_argument("file", nargs="?", help="the input JSONL (one request per line: custom_id, method, url, body)")
    batch.add_argument("--id", help="watch and download an existing batch instead of submitting one")
    batch.add_argument("--endpoint", default="/v1/chat/completions",
                       choices=["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"])
    batch.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    batch.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                       help="default: $OPENAI_API_KEY")
    batch.add_argument("--output", help="where the results go (default: <file or id>.out.jsonl; errors: .err.jsonl)")
    batch.add_argument("--no-wait", action="store_true", help="submit and print the batch id only")
    batch.set_defaults(func=cmd_batch)

    # Everything after `bench` is its own command line (loadgen/cli.py parses it): prefix_chars
    # that no argument uses makes argparse hand it over untouched, options and --help included.
    bench = sub.add_parser("bench", add_help=False, prefix_chars="\x00",
                           help="benchmark an OpenAI-compatible URL (`sluice bench --help`); "
                                "`--list` / `script NAME` for the bench/ scripts")
    bench.add_argument("argv", nargs="*")
    bench.set_defaults(func=cmd_bench)
    return p


def cmd_batch(args: argparse.Namespace) -> int:
    """`sluice batch FILE`: upload, create the batch, a progress bar until it ends, then the output and
    error files beside the input. Exit status 0 only when it completed with no failed line."""
    import openai
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if not args.file and not args.id:
        print("sluice batch: give an input FILE or --id", file=sys.stderr)
        return 2
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2)
    try:
        if args.id:
            b = client.batches.retrieve(args.id)
        else:
            with open(args.file, "rb") as fh:
                f = client.files.create(file=(Path(args.file).name, fh), purpose="batch")
            b = client.batches.create(input_file_id=f.id, endpoint=args.endpoint, completion_window="24h")
        print(b.id)
        if args.no_wait:
            return 0
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      transient=False) as bar:
            task = bar.add_task(b.status, total=None)
            while b.status not in ("completed", "failed", "cancelled", "expired"):
                time.sleep(0.5)
                b = client.batches.retrieve(b.id)
                counts = b.request_counts
                if counts is not None:
                    bar.update(task, description=b.status, total=counts.total or None,
                               completed=counts.completed + counts.failed)
            bar.update(task, description=b.status)
    except openai.APIError as e:
        print(f"sluice batch: {e}", file=sys.stderr)
        return 1
    base = args.output or f"{args.file or b.id}.out.jsonl"
    for file_id, path in ((b.output_file_id, base), (b.error_file_id, base.replace(".out.jsonl", "") + ".err.jsonl")):
        if file_id:
            Path(path).write_bytes(client.files.content(file_id).content)
            print(f"wrote {path}")
    if b.status == "failed" and b.errors is not None:
        for err in (b.errors.data or [])[:10]:
            print(f"line {err.line}: {err.code}: {err.message}", file=sys.stderr)
    counts = b.request_counts
    return 0 if b.status == "completed" and (counts is None or counts.failed == 0) else 1


def _bench_scripts() -> tuple[Path, list[str]]:
    """The developer scripts in the source tree's bench/ folder (not installed with the package)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench").is_dir():
        return root, []
    return root, sorted(p.stem for p in (root / "bench").glob("*.py")
                        if p.stem not in ("__init__", "common", "driver") and not p.stem.startswith("_"))


def cmd_bench(args: argparse.Namespace) -> int:
    """`sluice bench [OPTIONS]`: the load generator (loadgen/). `sluice bench --list`: the scripts
    in bench/; `sluice bench script NAME [ARGS]` runs one (so does `sluice bench NAME [ARGS]`)."""
    import importlib

    argv: list[str] = list(args.argv)
    root, scripts = _bench_scripts()
    if argv[:1] == ["--list"]:
        if not scripts:
            print("bench/ is not next to the gateway package: the scripts need a source checkout", file=sys.stderr)
            return 2
        for name in scripts:
            print(f"{name:20} {_first_doc_line(root / 'bench' / f'{name}.py')}")
        return 0
    if argv[:1] == ["script"] or (argv and argv[0] in scripts):
        if argv[0] == "script":
            argv = argv[1:]
        if not argv or argv[0] not in scripts:
            print("scripts in bench/: " + (", ".join(scripts) or "none (not a source checkout)"), file=sys.stderr)
            return 2
        sys.path.insert(0, str(root))
        importlib.import_module(f"bench.{argv[0]}").main(argv[1:])
        return 0
    from loadgen.cli import main as bench_main  # here, when used: serving never loads the client

    return bench_main(argv)


def _first_doc_line(path: Path) -> str:
    import ast

    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError):
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
