"""Gateway variants side by side on a remote route: several `sluice serve` processes (each with its own
environment, or its own source tree) in front of one zero-latency mock, measured row by row in
rotation (every variant at a concurrency, then the next round), so that the noise of a shared machine
falls on all of them alike. Prints per variant the median over rounds of CPU per request (from /proc),
req/s and p50, and each as a ratio to the first variant.

    python -m bench.gateway_variants --variant base= --variant uvloop=PERF_UVLOOP=1 \\
        [--variant NAME=@/path/to/tree,KEY=VALUE,...] [--modes json,stream] [--concurrency 64]
        [--seconds 3] [--rounds 3] [--keyed]

A variant is NAME=[@TREE,][+keyed,]KEY=VALUE,...: environment variables for that gateway process,
optionally a source tree to run it from (a copy of this checkout with a change in it), and `+keyed`
to serve it in key mode (a created key) instead of anonymously. Variables
such as PYTHONPATH are replaced, not appended to (the tree, or this checkout, is set first).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from bench.remote_overhead import MODEL, run_load, sluice_token, start_mock, start_sluice, stop
from bench.server import ROOT


def parse_variant(spec: str) -> tuple[str, Path, dict[str, str], bool]:
    name, _, rest = spec.partition("=")
    root, env, keyed = ROOT, {}, False
    for part in [x for x in rest.split(",") if x]:
        if part == "+keyed":
            keyed = True
        elif part.startswith("@"):
            root = Path(part[1:]).resolve()
        else:
            k, _, v = part.partition("=")
            env[k] = v
    if "PYTHONPATH" in env:
        env["PYTHONPATH"] = f"{root}:{env['PYTHONPATH']}"
    return name, root, env, keyed


async def main_async(args: argparse.Namespace) -> None:
    variants = [parse_variant(v) for v in args.variant]
    procs = []
    mock_p, mock = start_mock()
    procs.append(mock_p)
    try:
        gws = []
        for name, root, env, keyed in variants:
            tmp = tempfile.mkdtemp(prefix=f"sluice-variant-{name}-")
            p, base = start_sluice(mock, tmp, extra_env=env, keyed=args.keyed or keyed, root=root)
            procs.append(p)
            gws.append((name, p, base, sluice_token(tmp), tmp))
            print(f"# {name}: tree {root}, env {env}, {'keyed' if args.keyed or keyed else 'anonymous'}, "
                  f"log {tmp}/sluice.log", flush=True)
        rows: dict = {}
        for rnd in range(args.rounds):
            for mode in args.modes.split(","):
                for c in [int(x) for x in args.concurrency.split(",")]:
                    order = gws if rnd % 2 == 0 else list(reversed(gws))  # alternate who goes first
                    for name, p, base, token, _ in order:
                        r = await run_load(base, MODEL, mode == "stream", c, args.seconds, p.pid, args.grace, token)
                        rows.setdefault((mode, c, name), []).append(r)
                        print(f"  round {rnd} {mode:6} c={c:<4} {name:14} {r['rps']:8.1f} req/s  p50 {r['p50']:7.2f} ms"
                              f"  cpu/req {r['cpu_ms']:6.3f} ms  err {r['errors']}  [client {r['client_cpu_util'] * 100:3.0f}% cpu]",
                              flush=True)
        print("# medians over rounds; ratio = variant / first variant")
        for mode in args.modes.split(","):
            for c in [int(x) for x in args.concurrency.split(",")]:
                ref = None
                for name, *_ in gws:
                    rs = rows[(mode, c, name)]
                    cpu = statistics.median(r["cpu_ms"] for r in rs)
                    rps = statistics.median(r["rps"] for r in rs)
                    p50 = statistics.median(r["p50"] for r in rs)
                    if ref is None:
                        ref = (cpu, rps, p50)
                    print(f"{mode:6} c={c:<4} {name:14} cpu/req {cpu:6.3f} ms ({cpu / ref[0]:5.2f}x, "
                          f"{cpu - ref[0]:+6.3f} ms)  req/s {rps:8.1f} ({rps / ref[1]:5.2f}x)  p50 {p50:7.2f} ms "
                          f"({p50 / ref[2]:5.2f}x)", flush=True)
    finally:
        for p in procs:
            stop(p)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, help="NAME=[@TREE,][+keyed,]KEY=VALUE,...")
    p.add_argument("--modes", default="json,stream")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--grace", type=float, default=20.0)
    p.add_argument("--keyed", action="store_true", help="every gateway in key mode (a created key)")
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
