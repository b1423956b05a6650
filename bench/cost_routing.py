"""Cost-aware routing: a mixed pro/standard workload through `sluice serve` with a priced remote provider.

Starts the local mock provider (tests/fixtures/mock_provider.py: fault-free, `--itl-ms` per token so remote
answers stream like a real provider) and `sluice serve` with the real local model and one `[[providers]]`
entry that serves the local model's name at `--in-price`/`--out-price` (dollars per million tokens), so
traffic overflows to it when the estimated local queue wait exceeds the tier's `max_queue_wait_ms`. Creates
a pro and a standard key, then runs `sluice bench` (loadgen/: its workload, runner and stats) at a
Poisson `--rate` for `--duration` seconds with `--pro-share` pro requests, and prints:

* requests by tier and backend;
* the cost as billed: the bench's per-request cost (local at `--local-price`, default free; remote at the
  provider's prices) and the gateway's own `GET /v1/usage` delta;
* the all-remote cost: every request's prompt and completion tokens at the provider's prices;
* the ratio cost / all-remote (goal <= 0.30);
* pro TTFT p50 / p99 against the pro target, `tiers.pro.max_queue_wait_ms` + `--allowance-ms` (default
  1000: the local prefill and first decode step after the queue wait the router targets; a remote answer's
  TTFT is the provider's, `--ttft-ms`).

    python -m bench.cost_routing [--rate 6] [--duration 75] [--pro-share 0.3] [--json out.json]

Everything it starts runs on free loopback ports and is stopped on exit (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from bench.server import ROOT, free_port, managed_server, sluice_server_process
from loadgen import cli as bench_cli
from loadgen.stats import num, percentiles, sub

MODEL = "SmolLM2-135M-Instruct"
PROVIDER = "mockpaid"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


@contextlib.contextmanager
def mock_provider(tokens: int, itl_ms: float, ttft_ms: float):
    """Yields the base URL of `python -m tests.fixtures.mock_provider` on a free port; stops it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.fixtures.mock_provider", "--port", str(port), "--tokens", str(tokens),
           "--itl-ms", str(itl_ms), "--ttft-ms", str(ttft_ms)]
    # It has no GET route: ready once the port accepts connections.
    with managed_server(cmd, port, {**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT):
        yield f"http://127.0.0.1:{port}/v1"


def write_config(path: Path, provider_url: str, args: argparse.Namespace) -> None:
    local = (f"local_price = {{ input_per_m = {args.local_price[0]}, output_per_m = {args.local_price[1]} }}\n"
             if any(args.local_price) else "")
    path.write_text(f"""
[engine]
kv_cache_tokens = {args.kv_tokens}
max_running_requests = {args.max_running}

[routing]
overflow = true
{local}
[tiers.pro]
priority = 0
max_queue_wait_ms = {args.pro_wait_ms}

[tiers.standard]
priority = 1
max_queue_wait_ms = {args.standard_wait_ms}

[[providers]]
name = "{PROVIDER}"
base_url = "{provider_url}"
models = {{ "{MODEL}" = "mock-mini" }}
input_price_per_m = {args.in_price}
output_price_per_m = {args.out_price}
timeout_s = 30
max_concurrent = 256
order = 0
""")


def create_key(config: Path, keys_file: str, name: str, tier: str) -> str:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "create", "--config", str(config),
                          "--keys-file", keys_file, "--name", name, "--tier", tier],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()[0]


def _price(price: tuple[float, float], prompt: float, completion: float) -> float:
    return (prompt * price[0] + completion * price[1]) / 1e6


def report(doc: dict[str, object], args: argparse.Namespace, console: Console) -> dict[str, object]:
    level = doc["levels"][0]  # type: ignore[index]
    summary = sub(level, "summary")
    requests = level["requests"]  # type: ignore[index]
    remote_price = (args.in_price, args.out_price)
    local_price = tuple(args.local_price)
    # by tier x backend
    table: dict[tuple[str, str], int] = {}
    for r in requests:
        table[(r["tier"], r["backend"])] = table.get((r["tier"], r["backend"]), 0) + 1
    ok = [r for r in requests if r["ok"]]
    billed = sum(_price(remote_price if r["backend"].startswith("remote") else local_price,  # type: ignore[arg-type]
                        r["prompt_tokens"] or 0, r["output_tokens"]) for r in ok)
    all_remote = sum(_price(remote_price, r["prompt_tokens"] or 0, r["output_tokens"]) for r in ok)
    gw = sub(level, "gateway_usage", "totals")
    gw_cost = num(gw, "cost")
    ratio = billed / all_remote if all_remote else None
    pro = sub(summary, "by_tier", "pro")
    p50, p99 = num(pro, "ttft_ms", "p50"), num(pro, "ttft_ms", "p99")
    target = args.pro_wait_ms + args.allowance_ms
    pro_local = [r["ttft_ms"] for r in ok if r["tier"] == "pro" and r["backend"] == "local" and r["ttft_ms"]]
    local_tokens = sum((r["prompt_tokens"] or 0) + r["output_tokens"] for r in ok if r["backend"] == "local")
    all_tokens = sum((r["prompt_tokens"] or 0) + r["output_tokens"] for r in ok)

    console.print(f"\n[bold]cost routing[/]  cpu: {cpu_model()} ({os.cpu_count()} cpus)  rate {args.rate}/s for "
                  f"{args.duration:g} s, pro share {args.pro_share}, input {args.input_len} / output "
                  f"{args.output_len} words/tokens; provider {args.in_price}:{args.out_price} $/M, {args.itl_ms:g} "
                  f"ms/token, TTFT {args.ttft_ms:g} ms; local {local_price[0]}:{local_price[1]} $/M")
    console.print("requests by tier and backend (ok + errors):")
    for (tier, backend), n in sorted(table.items()):
        console.print(f"  {tier:<9} {backend:<18} {n}")
    errors = len(requests) - len(ok)
    console.print(f"  errors: {errors} {summary.get('errors_by_kind') or ''}")
    console.print(f"tokens served locally: {local_tokens}/{all_tokens} "
                  f"({local_tokens / all_tokens:.1%})" if all_tokens else "no tokens")
    console.print(f"cost (bench, per request): ${billed:.6f}   gateway /v1/usage delta: "
                  f"{'n/a' if gw_cost is None else f'${gw_cost:.6f}'} ({int(num(gw, 'requests') or 0)} requests)")
    console.print(f"all-remote cost of the same tokens at the provider's prices: ${all_remote:.6f}")
    verdict = "n/a" if ratio is None else ("PASS" if ratio <= 0.30 else "FAIL")
    console.print(f"ratio cost / all-remote: {'n/a' if ratio is None else f'{ratio:.3f}'} (goal <= 0.30: {verdict})")

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0f} ms"

    ttft_ok = p99 is not None and p99 <= target
    console.print(f"pro TTFT p50 {ms(p50)}, p99 {ms(p99)} (local-only p99 "
                  f"{ms(percentiles(pro_local)['p99'])}); "
                  f"target: tiers.pro.max_queue_wait_ms {args.pro_wait_ms:g} + {args.allowance_ms:g} ms allowance "
                  f"= {target:g} ms: {'PASS' if ttft_ok else 'FAIL'}")
    std = sub(summary, "by_tier", "standard")
    console.print(f"standard TTFT p50 {ms(num(std, 'ttft_ms', 'p50'))}, p99 {ms(num(std, 'ttft_ms', 'p99'))}")
    return {"cpu": cpu_model(), "by_tier_backend": {f"{t}/{b}": n for (t, b), n in table.items()},
            "errors": errors, "cost": billed, "gateway_cost": gw_cost, "all_remote_cost": all_remote,
            "ratio": ratio, "pro_ttft_p50_ms": p50, "pro_ttft_p99_ms": p99, "pro_target_ms": target,
            "cost_goal_met": ratio is not None and ratio <= 0.30, "pro_ttft_goal_met": ttft_ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=75.0, help="seconds of arrivals (in-flight ones finish)")
    p.add_argument("--pro-share", type=float, default=0.3)
    p.add_argument("--input-len", default="uniform:32:128", help="prompt words (sluice bench DIST)")
    p.add_argument("--output-len", default="uniform:16:48", help="max_tokens (sluice bench DIST)")
    p.add_argument("--in-price", type=float, default=0.15, help="provider $ per million prompt tokens")
    p.add_argument("--out-price", type=float, default=0.60, help="provider $ per million completion tokens")
    p.add_argument("--local-price", type=float, nargs=2, default=(0.0, 0.0), metavar=("IN", "OUT"),
                   help="routing.local_price ($/M; default free)")
    p.add_argument("--itl-ms", type=float, default=20.0, help="provider per-token delay")
    p.add_argument("--ttft-ms", type=float, default=300.0, help="provider time to first token")
    p.add_argument("--pro-wait-ms", type=float, default=10000.0, help="tiers.pro.max_queue_wait_ms")
    p.add_argument("--standard-wait-ms", type=float, default=2000.0, help="tiers.standard.max_queue_wait_ms")
    p.add_argument("--allowance-ms", type=float, default=1000.0, help="pro target = pro wait + this")
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the bench document and the figures")
    args = p.parse_args(argv)
    if not 0 <= args.pro_share <= 1:
        p.error("--pro-share: between 0 and 1")

    console = Console(width=int(os.environ.get("COLUMNS", "160")), soft_wrap=False)
    tmp = Path(tempfile.mkdtemp(prefix="sluice-cost-"))
    config, keys_file = tmp / "sluice.toml", str(tmp / "keys.json")
    try:
        with mock_provider(4096, args.itl_ms, args.ttft_ms) as provider_url:  # max_tokens caps its answers
            write_config(config, provider_url, args)
            pro_key = create_key(config, keys_file, "bench-pro", "pro")
            std_key = create_key(config, keys_file, "bench-standard", "standard")
            env = {"SLUICE_AUTH__KEYS_FILE": keys_file, "SLUICE_USAGE__LEDGER_PATH": str(tmp / "usage.sqlite3")}
            with sluice_server_process(env, ["--config", str(config)]) as (base_url, _):
                out_json = str(tmp / "bench.json")
                mix = f"pro={args.pro_share},standard={1 - args.pro_share}"
                bench_argv = ["--base-url", base_url, "--model", MODEL, "--rate", str(args.rate),
                              "--max-concurrency", str(args.max_concurrency), "--duration", str(args.duration),
                              "--tier-mix", mix, "--key", f"pro={pro_key}", "--key", f"standard={std_key}",
                              "--input-len", args.input_len, "--output-len", args.output_len, "--seed", str(args.seed),
                              "--extra-body", '{"temperature": 0}', "--timeout", "120",
                              "--price-backend", f"local={args.local_price[0]}:{args.local_price[1]}",
                              "--price-backend", f"remote:{PROVIDER}={args.in_price}:{args.out_price}",
                              "--json", out_json, "--no-progress"]
                rc = asyncio.run(bench_cli.amain(bench_argv, console=console))
                if rc != 0:
                    return rc
                doc = json.loads(Path(out_json).read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # config, keys, ledger
    figures = report(doc, args, console)
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "bench": doc}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
