"""`sluice bench`: load an OpenAI-compatible base URL and report per level, tier and backend.

    sluice bench [--base-url URL] [--endpoint chat|embeddings] [--model NAME]
                 [--concurrency 1,4,16 | --rate 2,8 [--max-concurrency N]] [--requests N] [--duration S]
                 [workload options, --inputs-per-request N] [--tier-mix pro=0.3,standard=0.7
                 --key pro=sk-... --key standard=sk-...] [--slo-ttft-ms MS [--slo-itl-ms MS]]
                 [--price MODEL=IN:OUT] [--price-backend BACKEND=IN:OUT] [--json out.json] [--plot out.png]
    sluice bench --compare a.json b.json

`main(argv)` runs it (exit status 0; 1 when the warm-up fails or no request succeeded; 2 for a usage
error); `amain(argv)` is the same inside a running event loop (tests).

`--endpoint embeddings` sends `POST /embeddings` requests of `--inputs-per-request` synthetic texts
of `--input-len` words each, and reports requests/s, inputs/s, prompt tok/s and latency instead of
the streaming figures (TTFT, ITL, output tok/s, goodput: its options are usage errors there).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit, urlunsplit

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadgen import usage as gw_usage
from loadgen.client import ENDPOINTS, NotOpenAI, RequestResult, Sender, error_kind
from loadgen.report import compare_table, endpoint_of, print_level, sweep_table
from loadgen.runner import Level, LevelRun, run_level
from loadgen.stats import PriceError, Prices, Slo, parse_price, sub, summarise
from loadgen.workload import (
    LEVEL_STRIDE,
    LengthDist,
    Rag,
    Recorded,
    Synthetic,
    SyntheticEmbeddings,
    TierMix,
    Workload,
    WorkloadError,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_TIER = "default"
KEY_ENV_PREFIX = "SLUICE_BENCH_KEY_"
FORMAT_VERSION = 1


class UsageError(ValueError):
    """A command line that cannot run: printed, exit status 2."""


class BenchFailed(RuntimeError):
    """The target cannot be benchmarked (the warm-up failed): printed, exit status 1."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice bench",
        description="Benchmark any OpenAI-compatible base URL (Sluice or not) with streamed chat requests "
                    "through the openai SDK: requests/s, output tok/s, TTFT / ITL / e2e percentiles, errors by "
                    "kind, goodput under an SLO, by tier and by backend (x-sluice-backend), and cost. With "
                    "--endpoint embeddings: embeddings requests, and requests/s, inputs/s, prompt tok/s and "
                    "latency percentiles instead.",
        epilog="Also: `sluice bench --list` lists the developer scripts in bench/, `sluice bench script NAME "
               "[ARGS]` runs one. Lengths (DIST): N or fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help="the OpenAI base URL (with /v1; a bare host:port gets /v1 added)")
    t.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                   help="chat: streamed /chat/completions; embeddings: /embeddings (synthetic workload only)")
    t.add_argument("--model", help="model name (default: a JSONL line's own, else the first of GET /models; "
                                   "embeddings: the only one GET /models lists, else required)")
    t.add_argument("--api-key", default=None,
                   help="key for requests of a tier without its own key (default: $OPENAI_API_KEY, else 'none')")
    t.add_argument("--key", action="append", default=[], metavar="TIER=KEY",
                   help=f"the API key of a tier (repeat per tier; or ${KEY_ENV_PREFIX}<TIER>)")
    t.add_argument("--tier-mix", metavar="TIER=W,...",
                   help="share of requests per tier, e.g. pro=0.3,standard=0.7 (default: the tiers with "
                        "--key, evenly; none: one tier, 'default')")
    t.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take in all")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("synthetic", "rag", "jsonl"), default=None,
                   help="default: jsonl with --dataset, else synthetic")
    w.add_argument("--dataset", metavar="FILE.jsonl", help="recorded requests: one OpenAI chat body per line")
    w.add_argument("--input-len", default="256", metavar="DIST",
                   help="prompt words (about tokens); rag: the question's")
    w.add_argument("--output-len", default=None, metavar="DIST",
                   help="max_tokens (default 128; jsonl: each line's own)")
    w.add_argument("--inputs-per-request", type=int, default=None, metavar="N",
                   help="embeddings: texts per request, each of --input-len words (default 1: a query; 64+: "
                        "ingest)")
    w.add_argument("--docs", type=int, default=4, help="rag: shared documents")
    w.add_argument("--doc-len", type=int, default=1024, help="rag: words per document")
    w.add_argument("--extra-body", metavar="JSON", help='fields added to every body, e.g. \'{"temperature": 0}\'')
    w.add_argument("--seed", type=int, default=0, help="same seed, same requests and arrival times")
    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", default=None, metavar="C,...", help="concurrency sweep, e.g. 1,4,16,64 "
                    "(default 1 without --rate)")
    ld.add_argument("--rate", default=None, metavar="R,...",
                    help="Poisson arrival rates in requests/s (a sweep: 2,4,8; inf: all at once)")
    ld.add_argument("--max-concurrency", type=int, default=None, help="with --rate: at most this many in flight")
    ld.add_argument("--requests", type=int, default=None, help="requests per level (default 100 without --duration)")
    ld.add_argument("--duration", type=float, default=None, help="seconds per level (no new request after it)")
    ld.add_argument("--warmup", type=int, default=1,
                    help="requests per tier sent first, not counted (opens connections, checks each key); "
                         "one that fails stops the run")
    f = p.add_argument_group("figures")
    f.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    f.add_argument("--slo-itl-ms", type=float, default=None,
                   help="goodput: and a mean inter-token latency at most this")
    f.add_argument("--price", action="append", default=[], metavar="MODEL=IN:OUT",
                   help="dollars per million input:output tokens for a model (repeat)")
    f.add_argument("--price-backend", action="append", default=[], metavar="BACKEND=IN:OUT",
                   help="the same per x-sluice-backend value, e.g. local=0:0, remote:holysheep=0.15:0.6 (wins "
                        "over --price)")
    f.add_argument("--no-gateway-usage", action="store_true",
                   help="do not read GET /v1/usage before and after each level (Sluice's own accounting)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the summary and every request's raw result")
    o.add_argument("--plot", metavar="FILE.png", help="draw throughput, TTFT, ITL and the backend split (needs "
                   "matplotlib: the `ops` extra)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print ratios b / a of two --json files' main figures, and exit")
    return p


# ---------------------------------------------------------------- parsing helpers


def normalise_base_url(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--base-url {url!r}: need http(s)://host[:port][/path]")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _numbers(text: str, what: str, conv: Callable[[str], float]) -> list[float]:
    try:
        values = [conv(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"{what} {text!r}: a comma-separated list of numbers") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{what} {text!r}: positive numbers")
    return values


def levels_from(args: argparse.Namespace) -> list[Level]:
    if args.rate is not None and args.concurrency is not None:
        raise UsageError("give --concurrency or --rate, not both (--max-concurrency caps a rate)")
    if args.rate is not None:
        rates = _numbers(args.rate, "--rate", float)
        if any(math.isinf(r) for r in rates) and args.requests is None and args.duration is not None:
            raise UsageError("--rate inf sends everything at once: bound it with --requests, not --duration")
        return [Level(rate=r, max_concurrency=args.max_concurrency) for r in rates]
    if args.max_concurrency is not None:
        raise UsageError("--max-concurrency goes with --rate")
    return [Level(concurrency=int(c)) for c in _numbers(args.concurrency or "1", "--concurrency", int)]


def tier_keys(args: argparse.Namespace, environ: dict[str, str]) -> tuple[TierMix, dict[str, str], str]:
    """(tier mix, key per tier, the default key) from --key, $SLUICE_BENCH_KEY_<TIER>, --tier-mix."""
    keys: dict[str, str] = {}
    for item in args.key:
        tier, sep, key = item.partition("=")
        if not sep or not tier or not key:
            raise UsageError(f"--key {item.split('=')[0]}=...: TIER=KEY")
        keys[tier] = key
    default_key = args.api_key or environ.get("OPENAI_API_KEY") or "none"
    if args.tier_mix:
        mix = TierMix.parse(args.tier_mix)
        for tier in mix.tiers:
            env = KEY_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", tier.upper())
            if tier not in keys and environ.get(env):
                keys[tier] = environ[env]
            if tier not in keys:
                raise UsageError(f"no API key for tier {tier!r}: --key {tier}=sk-... or ${env}")
    elif keys:
        mix = TierMix({t: 1.0 for t in keys})
    else:
        mix = TierMix({DEFAULT_TIER: 1.0})
    return mix, keys, default_key


def prices_from(args: argparse.Namespace) -> Prices:
    try:
        return Prices(by_model=dict(parse_price(p) for p in args.price),
                      by_backend=dict(parse_price(p) for p in args.price_backend))
    except PriceError as e:
        raise UsageError(str(e)) from None


def _extra_body(text: str | None) -> dict[str, object]:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError("--extra-body: not JSON") from None
    if not isinstance(body, dict):
        raise UsageError("--extra-body: a JSON object")
    return body


def check_endpoint(args: argparse.Namespace) -> None:
    """Usage errors for options that mean nothing at this endpoint (before anything is sent)."""
    if args.endpoint != "embeddings":
        if args.inputs_per_request is not None:
            raise UsageError("--inputs-per-request goes with --endpoint embeddings")
        return
    given = [f"--workload {args.workload}"] if args.workload not in (None, "synthetic") else []
    given += [opt for opt, value in (("--dataset", args.dataset), ("--output-len", args.output_len),
                                     ("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-itl-ms", args.slo_itl_ms))
              if value is not None]
    if given:
        raise UsageError(f"--endpoint embeddings takes no {', '.join(given)} (it sends synthetic inputs of "
                         "--input-len words, --inputs-per-request per request, and has no stream: no TTFT / ITL)")
    if args.inputs_per_request is not None and args.inputs_per_request < 1:
        raise UsageError(f"--inputs-per-request {args.inputs_per_request}: at least 1")


async def workload_from(args: argparse.Namespace, mix: TierMix, sender: Sender) -> Workload:
    kind = args.workload or ("jsonl" if args.dataset else "synthetic")
    extra = _extra_body(args.extra_body)
    if args.endpoint == "embeddings":
        model = args.model or await embeddings_model(sender)
        return SyntheticEmbeddings(model, LengthDist.parse(args.input_len), args.inputs_per_request or 1, mix,
                                   seed=args.seed, extra_body=extra)
    output_len = LengthDist.parse(args.output_len) if args.output_len else None
    if kind == "jsonl":
        if not args.dataset:
            raise UsageError("--workload jsonl needs --dataset FILE.jsonl")
        return Recorded(args.dataset, mix, model=args.model, output_len=output_len, seed=args.seed, extra_body=extra)
    model = args.model or await default_model(sender)
    input_len = LengthDist.parse(args.input_len)
    out = output_len or LengthDist("fixed", 128)
    if kind == "rag":
        return Rag(model, args.docs, args.doc_len, input_len, out, mix, seed=args.seed, extra_body=extra)
    return Synthetic(model, input_len, out, mix, seed=args.seed, extra_body=extra)


async def _listed_models(sender: Sender) -> list[str]:
    try:
        models = await sender.models()
    except NotOpenAI as e:
        raise UsageError(f"no --model given and {e}") from None
    except Exception as e:
        kind, detail = error_kind(e)
        raise UsageError(f"no --model given and GET /models failed ({kind}: {detail})") from None
    if not models:
        raise UsageError("no --model given and GET /models lists none")
    return models


async def default_model(sender: Sender) -> str:
    return (await _listed_models(sender))[0]


async def embeddings_model(sender: Sender) -> str:
    """The model GET /models lists when it lists one; with several, which one embeds cannot be told from
    the ids (a usage error naming them)."""
    models = await _listed_models(sender)
    if len(models) > 1:
        shown = ", ".join(models[:20]) + (f", ... ({len(models) - 20} more)" if len(models) > 20 else "")
        raise UsageError(f"--endpoint embeddings needs --model: GET /models lists {len(models)} models, and "
                         f"which one is an embedding model is not known (choose one: {shown})")
    return models[0]


# ---------------------------------------------------------------- running


def _progress(console: Console, requests: int | None, enabled: bool) -> Progress:
    columns = [TextColumn("[bold]{task.description}"), BarColumn(),
               MofNCompleteColumn() if requests is not None else TextColumn("{task.completed:.1f}/{task.total:g} s"),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
    return Progress(*columns, console=console, transient=True, disable=not enabled)


async def run_bench(args: argparse.Namespace, console: Console, err_console: Console,
                    environ: dict[str, str] | None = None) -> tuple[dict[str, object], list[dict[str, object]]]:
    """Runs every level; prints a table per level (and a sweep table); returns the --json document and
    its levels."""
    environ = dict(os.environ) if environ is None else environ
    check_endpoint(args)
    base_url = normalise_base_url(args.base_url)
    levels = levels_from(args)
    mix, keys, default_key = tier_keys(args, environ)
    prices = prices_from(args)
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    requests = args.requests if args.requests is not None or args.duration is not None else 100
    if requests is not None and requests < 1:
        raise UsageError("--requests must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be positive")
    max_in_flight = max((lv.concurrency or lv.max_concurrency or 0) for lv in levels) or 1024
    sender = Sender(base_url, keys, default_key, timeout_s=args.timeout, max_connections=max(max_in_flight, 1),
                    endpoint=args.endpoint)
    try:
        try:
            workload = await workload_from(args, mix, sender)
        except WorkloadError as e:
            raise UsageError(str(e)) from None
        usage_keys: dict[str, str | None] = {t: keys.get(t, default_key) for t in mix.tiers}
        await _warm_up(workload, sender, mix, args.warmup)
        out_levels: list[dict[str, object]] = []
        for n, level in enumerate(levels):
            before = None if args.no_gateway_usage else await gw_usage.snapshot(base_url, usage_keys)
            run = await _run_one(level, workload, sender, requests, args, err_console, LEVEL_STRIDE * n)
            prices.apply(run.results)
            summary = summarise(run.results, run.duration_s, slo, endpoint=args.endpoint)
            gateway = None
            if before is not None:
                gateway = await gw_usage.settled_delta(base_url, usage_keys, before,
                                                       sum(1 for r in run.results if r.ok))
            lv: dict[str, object] = {"level": level.to_json(), "summary": summary, "gateway_usage": gateway,
                                     "requests": [r.to_json() for r in run.results]}
            out_levels.append(lv)
            print_level(console, lv)
        if len(out_levels) > 1:
            console.print(sweep_table(out_levels))
    finally:
        await sender.close()
    config: dict[str, object] = {
        "base_url": base_url, "endpoint": args.endpoint, **workload.describe(), "tier_mix": str(mix),
        "tiers_with_keys": sorted(keys),
        "levels": [lv.to_json() for lv in levels], "requests_per_level": requests, "duration_s": args.duration,
        "timeout_s": args.timeout, "seed": args.seed, "slo": slo.to_json(),
        "prices": {"by_model": prices.by_model, "by_backend": prices.by_backend}}
    doc: dict[str, object] = {"sluice_bench": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "config": config, "levels": out_levels}
    return doc, out_levels


async def _warm_up(workload: Workload, sender: Sender, mix: TierMix, n: int) -> None:
    """`n` requests per tier, one after another, before the first level; any failure stops the run."""
    t0 = time.perf_counter()
    for i in range(n):
        for tier in mix.tiers:
            spec = dataclasses.replace(workload.request(-1 - i), tier=tier)
            r = await sender.send(spec, t0)
            if not r.ok:
                raise BenchFailed(f"warm-up request (tier {tier}) failed: {r.error}: {r.error_detail} "
                                  "(--warmup 0 skips the warm-up)")


async def _run_one(level: Level, workload: Workload, sender: Sender, requests: int | None,
                   args: argparse.Namespace, err_console: Console, first_index: int) -> LevelRun:
    enabled = not args.no_progress and err_console.is_terminal
    with _progress(err_console, requests, enabled) as progress:
        total = float(requests) if requests is not None else float(args.duration)
        task = progress.add_task(level.label, total=total, status="")
        counts = {"ok": 0, "err": 0}

        def on_result(r: RequestResult) -> None:
            counts["ok" if r.ok else "err"] += 1
            status = f"ok {counts['ok']}" + (f" [red]errors {counts['err']}[/]" if counts["err"] else "")
            if requests is not None:
                progress.update(task, advance=1, status=status)
            else:
                progress.update(task, status=status)

        async def tick() -> None:
            t0 = time.perf_counter()
            while True:
                progress.update(task, completed=min(time.perf_counter() - t0, total))
                await asyncio.sleep(0.2)

        ticker = asyncio.create_task(tick()) if requests is None and enabled else None
        try:
            return await run_level(level, workload, sender.send, requests=requests, duration_s=args.duration,
                                   seed=args.seed, first_index=first_index, on_result=on_result)
        finally:
            if ticker is not None:
                ticker.cancel()


def _all_failed(levels: list[dict[str, object]]) -> str | None:
    """What went wrong when not one request of the run succeeded (None when one did)."""
    results = [r for lv in levels for r in cast(list[dict[str, object]], lv["requests"])]
    if any(r["ok"] for r in results):
        return None
    if not results:
        return "no request was sent"
    kinds: dict[str, int] = {}
    for r in results:
        kinds[str(r["error"])] = kinds.get(str(r["error"]), 0) + 1
    by_kind = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items(), key=lambda kn: -kn[1]))
    return f"every request failed (0/{len(results)} succeeded; {by_kind})"


def _read_json(path: str) -> list[dict[str, object]]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--compare: cannot read {path}: {e}") from None
    levels = doc.get("levels") if isinstance(doc, dict) else None
    if not isinstance(levels, list) or not all(isinstance(lv, dict) for lv in levels):
        raise UsageError(f"--compare: {path} is not a `sluice bench --json` file")
    return levels


def _consoles() -> tuple[Console, Console]:
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "200"))
    return Console(width=width, soft_wrap=False), Console(stderr=True)


async def amain(argv: list[str], console: Console | None = None, err_console: Console | None = None) -> int:
    args = build_parser().parse_args(argv)
    out, err = _consoles()
    console, err_console = console or out, err_console or err
    try:
        if args.compare:
            a, b = (_read_json(p) for p in args.compare)
            ends = [endpoint_of(sub(levels[0], "summary")) if levels else "chat" for levels in (a, b)]
            if ends[0] != ends[1]:
                raise UsageError(f"--compare: {args.compare[0]} is a run of --endpoint {ends[0]} and "
                                 f"{args.compare[1]} of --endpoint {ends[1]}: their figures differ")
            console.print(compare_table(args.compare[0], args.compare[1], a, b))
            return 0
        doc, levels = await run_bench(args, console, err_console)
    except UsageError as e:
        err_console.print(f"sluice bench: {e}", markup=False, highlight=False)
        return 2
    except BenchFailed as e:
        err_console.print(f"sluice bench: {e}", markup=False, highlight=False)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        err_console.print(f"wrote {args.json}", markup=False, highlight=False)
    failed = _all_failed(levels)
    if failed is not None:  # no figure means anything: a script must not read this run as a result
        err_console.print(f"sluice bench: {failed}", markup=False, highlight=False)
        return 1
    if args.plot:
        from loadgen.plot import PlotUnavailable, plot

        config = sub(doc, "config")
        what = "embeddings" if config.get("endpoint") == "embeddings" else config.get("workload")
        title = f"sluice bench: {config.get('base_url')}  {what} {config.get('model') or ''}"
        try:
            plot(levels, args.plot, title=title)
        except PlotUnavailable as e:
            err_console.print(f"sluice bench: {e}", markup=False, highlight=False)
            return 2
        err_console.print(f"wrote {args.plot}", markup=False, highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    for noisy in ("httpx2", "httpx", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return asyncio.run(amain(list(sys.argv[1:] if argv is None else argv)))
    except KeyboardInterrupt:
        print("sluice bench: interrupted (nothing written)", file=sys.stderr)
        return 130
