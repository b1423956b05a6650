"""Where the gateway's CPU goes on a remote route: py-spy samples `sluice serve` under the same load as
`bench/remote_overhead.py` (zero-latency mock, closed loop), JSON and streamed separately, and prints
ranked tables: by area (aiohttp server, SDK/transport, json, pydantic, prometheus, logging, the event
loop, ...), by function self time and by function inclusive time, each as a percent of the gateway's
busy samples and as ms of CPU per request (the percent times the measured CPU per request).

    .venv/bin/pip install py-spy
    python -m bench.profile_remote [--seconds 8] [--concurrency 64] [--modes json,stream] [--top 30]
                                   [--out DIR] [--native] [--keyed] [--env KEY=VALUE ...] [--python PATH]
                                   [--root TREE]

`--out` keeps the collapsed stacks (`<mode>.txt`, for flamegraph.pl or speedscope.app) and the tables.
`--env` passes variables to the gateway (e.g. to try a setting); `--python` runs the gateway with
another interpreter. The load generator, the mock and the gateway share this machine's cores: compare
percentages and ratios within one run, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.remote_overhead import MODEL, run_load, sluice_token, start_mock, start_sluice, stop
from bench.server import ROOT

# (area, regex on "function (file:line)"): the first match of the innermost-first walk names the area
# of a sample's self time. Order matters: specific before general.
AREAS: list[tuple[str, str]] = [  # matched against the file of a frame, as py-spy names it (relative to sys.path)
    ("pydantic (validate / dump)", r"^(pydantic|pydantic_core)/"),
    ("json encode/decode", r"^(json/|orjson|jiter)"),
    ("prometheus_client", r"^prometheus_client/"),
    ("logging", r"^logging/"),
    ("tenacity (retry loop)", r"^tenacity/"),
    ("openai SDK", r"^openai/"),
    ("httpx2 (SDK's request/response model)", r"^(httpx2|httpcore2|httpx|httpcore)/"),
    ("aiohttp client (SDK transport)", r"^aiohttp/(client|connector|streams|client_proto|client_reqrep|tracing)"),
    ("aiohttp server (web_*, http_*)", r"^aiohttp/"),
    ("multidict/yarl/propcache", r"^(multidict|yarl|propcache)/"),
    ("anyio/sniffio", r"^(anyio|sniffio)/"),
    ("uuid", r"^uuid\.py"),
    ("asyncio event loop / transports", r"^(asyncio/|uvloop)"),
    ("gateway code", r"^gateway/"),
    ("engine code", r"^engine/"),
    ("other stdlib/imports", r"^(<frozen|[a-z_]+\.py|[a-z_]+/)"),
]
_AREA_RE = [(a, re.compile(p)) for a, p in AREAS]
_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


def area_of(frame: str) -> str | None:
    m = _FRAME.match(frame)
    if not m:
        return None
    loc = m.group(2)
    for a, r in _AREA_RE:
        if r.search(loc):
            return a
    return None


def parse_collapsed(path: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, n = line.rpartition(" ")
        try:
            out.append((stack.split(";"), int(n)))
        except ValueError:
            continue
    return out


def _short(frame: str) -> str:
    # "func (/long/path/site-packages/pkg/mod.py:123)" -> "func (pkg/mod.py:123)"
    m = re.match(r"(.*) \((.*)\)$", frame)
    if not m:
        return frame
    fn, loc = m.groups()
    for marker in ("site-packages/", "/lib/python3.11/", str(ROOT) + "/"):
        if marker in loc:
            loc = loc.split(marker, 1)[1]
            break
    return f"{fn} ({loc})"


def tables(stacks: list[tuple[list[str], int]], cpu_ms_req: float, top: int) -> str:
    """Ranked tables. py-spy writes stacks root first; a sample's self time is its innermost frame."""
    where: Counter = Counter()  # the event loop's thread, other threads, or a truncated stack
    for frames, n in stacks:
        root = frames[0] if frames else ""
        where["event loop thread" if root.startswith("_run_module_as_main") else
              "other threads" if root.startswith("Thread._bootstrap") else "truncated stacks"] += n
    # The event loop's thread does the serving. Other threads (the engine worker waiting for work, the
    # executor's idle workers) show up as "busy" in py-spy's blocking mode while they sit in a lock wait;
    # they are counted above and left out below.
    stacks = [(f, n) for f, n in stacks if f and not f[0].startswith("Thread._bootstrap")]
    total = sum(n for _, n in stacks)
    if not total:
        return "no samples\n"
    self_t: Counter = Counter()
    incl: Counter = Counter()
    area_t: Counter = Counter()
    for frames, n in stacks:
        self_t[_short(frames[-1])] += n
        for f in set(_short(f) for f in frames):
            incl[f] += n
        a = None
        for f in reversed(frames):  # innermost first: the first frame that names an area
            a = area_of(f)
            if a is not None:
                break
        area_t[a or "unattributed (C/native)"] += n

    def pct(n: int) -> str:
        return f"{100 * n / total:5.1f}%  {cpu_ms_req * n / total:6.3f} ms/req"

    all_n = sum(where.values())
    lines = [f"{total} samples of the event loop's thread; CPU per request measured {cpu_ms_req:.3f} ms (the ms/req "
             "columns split it by the samples' shares); all samples: "
             + ", ".join(f"{k} {100 * v / all_n:.1f}%" for k, v in where.most_common()), "", "## by area (self time)"]
    lines += [f"  {pct(n)}  {a}" for a, n in area_t.most_common()]
    lines += ["", f"## top {top} functions by self time"]
    lines += [f"  {pct(n)}  {f}" for f, n in self_t.most_common(top)]
    lines += ["", f"## top {top} functions by inclusive time (excluding the loop and task-step frames)"]
    skip = re.compile(r"^(<module>|run |run_forever|_run_once|_run |run_until_complete|main |_serve|_run_app|"
                      r"start_server|serve |_bootstrap|_bootstrap_inner|__call__ \(.*runners)")
    n_inc = 0
    for f, n in incl.most_common():
        if skip.match(f):
            continue
        lines.append(f"  {pct(n)}  {f}")
        n_inc += 1
        if n_inc >= top:
            break
    return "\n".join(lines) + "\n"


async def profile_mode(base: str, pid: int, mode: str, conc: int, seconds: float, rate: int, out: Path,
                       native: bool, pyspy: str, token: str, nonblocking: bool = False) -> tuple[dict, Path]:
    stacks = out / f"{mode}-c{conc}.txt"
    # warm up first (connections, first-request costs), then sample exactly the measured window
    await run_load(base, MODEL, mode == "stream", conc, 1.0, None, 10.0, token)
    cmd = [pyspy, "record", "--pid", str(pid), "--rate", str(rate), "--duration", str(int(seconds)),
           "--format", "raw", "--function", "--output", str(stacks)]
    if native:
        cmd.append("--native")
    if nonblocking:  # cheaper for the target, but some stacks come back truncated or garbled
        cmd.append("--nonblocking")
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    await asyncio.sleep(0.5)  # py-spy attaches
    r = await run_load(base, MODEL, mode == "stream", conc, seconds - 1.0, pid, 10.0, token)
    _, err = await asyncio.to_thread(spy.communicate)
    if spy.returncode != 0 and not stacks.exists():
        raise RuntimeError(f"py-spy failed: {err.decode()[-500:]}")
    return r, stacks


async def main_async(args: argparse.Namespace) -> None:
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if pyspy is None:
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")
    out = Path(args.out or tempfile.mkdtemp(prefix="sluice-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="sluice-profile-run-")
    env = dict(kv.split("=", 1) for kv in args.env)
    mock_p, mock = start_mock()
    procs = [mock_p]
    try:
        sl_p, sl = start_sluice(mock, tmp, extra_env=env, python=args.python, keyed=args.keyed,
                                root=Path(args.root).resolve() if args.root else None)
        procs.append(sl_p)
        report = []
        for mode in args.modes.split(","):
            for conc in [int(c) for c in args.concurrency.split(",")]:
                t0 = time.time()
                r, stacks = await profile_mode(sl, sl_p.pid, mode, conc, args.seconds, args.rate, out,
                                               args.native, pyspy, sluice_token(tmp), args.nonblocking)
                head = (f"# {mode} c={conc}: {r['rps']:.0f} req/s, cpu/req {r['cpu_ms']:.3f} ms "
                        f"(sampled by py-spy{' --nonblocking' if args.nonblocking else ''} at {args.rate} Hz, "
                        f"{time.time() - t0:.0f}s; the pauses cost some throughput), "
                        f"errors {r['errors']}")
                text = head + "\n" + tables(parse_collapsed(stacks), r["cpu_ms"], args.top)
                print(text, flush=True)
                report.append(text)
        (out / "report.txt").write_text("\n".join(report))
        print(f"# collapsed stacks and report: {out}")
    finally:
        for p in procs:
            stop(p)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--concurrency", default="64")
    p.add_argument("--modes", default="json,stream")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames too; slower)")
    p.add_argument("--nonblocking", action="store_true", help="py-spy --nonblocking (less overhead, torn stacks)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateway process")
    p.add_argument("--python", default=None, help="interpreter for the gateway (default: this one)")
    p.add_argument("--keyed", action="store_true", help="the gateway in key mode (a created key)")
    p.add_argument("--root", default=None, help="run the gateway from another source tree (a modified copy)")
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
