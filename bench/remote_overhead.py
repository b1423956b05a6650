"""Gateway overhead on a remote route: Sluice and LiteLLM proxy in front of the same mock provider,
against calling the mock directly.

Three processes besides this load generator: the zero-latency mock provider
(`tests/fixtures/mock_provider.py`, 16 tokens per answer), `sluice serve` with the mock as the only
provider of a remote-only model, and (when `bench/.venv-litellm` exists: `bench/setup_litellm.sh`)
`litellm --config` routing the same model name to the same mock. For each target, JSON and streamed,
at each concurrency (closed loop for `--seconds`), it reports requests/s, p50/p99 latency and what the
gateway adds to the direct figures, TTFT, the gateway's CPU per request (and per streamed chunk) from
/proc, and errors (a fast 429/503 under overload counts as an error, not a success). A second pass
streams from a mock with `--itl-ms` between tokens and compares the relayed inter-token time with the
upstream's (bunching would show as a smaller median gap and a larger p99). Last, a summary against
the gateway's goals: Sluice's CPU per JSON and streamed request at c=64 and c=256, its req/s as a multiple
of LiteLLM's, and the p50 it adds at c=1.

    python -m bench.remote_overhead [--seconds 6] [--concurrency 1,64,256] [--no-litellm]
                                    [--modes json,stream] [--no-fidelity] [--keyed]
                                    [--gateway-env KEY=VALUE ...] [--gateway-python PATH] [--gateway-root TREE]

`--keyed` serves Sluice in key mode (a key from `sluice keys create`, as a deployment runs) instead of
anonymous loopback mode; `--gateway-env`/`--gateway-python` run the gateway with other settings or
another interpreter (e.g. one whose sitecustomize installs uvloop) to compare variants run by run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import mean, pct
from bench.server import ROOT, free_port, wait_ready

MODEL = "bench-remote"
LITELLM_KEY = "sk-bench-" + os.urandom(16).hex()  # LiteLLM refuses to start without a master key
LITELLM = ROOT / "bench" / ".venv-litellm" / "bin" / "litellm"
TICK = os.sysconf("SC_CLK_TCK")
CONTENT = re.compile(rb'"content": ?"[^"]')  # a chunk with text (not the role-only or final chunk)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, plus live child processes."""
    total = 0.0
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in out]
    except Exception:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / TICK  # utime stime cutime cstime
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass
    return total


def start(cmd: list[str], env: dict | None = None, log: str = "/dev/null", cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd or ROOT, env={**os.environ, **(env or {})}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(15)
    except Exception:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except Exception:
            pass


def start_mock(itl_ms: float = 0.0, tokens: int = 16) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = start([sys.executable, "-m", "tests.fixtures.mock_provider", "--port", str(port), "--tokens", str(tokens),
               "--itl-ms", str(itl_ms)])
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            import urllib.request
            req = urllib.request.Request(base + "/chat/completions", data=json.dumps(
                {"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=2).read()
            return p, base
        except Exception:
            time.sleep(0.2)
    raise RuntimeError("mock provider did not start")


def start_sluice(mock: str, tmp: str, *, extra_env: dict[str, str] | None = None, python: str | None = None,
                 keyed: bool = False, root: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`sluice serve` in front of `mock`; returns the process and its base URL. `keyed`: a key is created
    first, so the gateway runs in key mode (its token: `sluice_token(tmp)`). `root`: another source tree
    to run the gateway from (default: this checkout)."""
    root = root or ROOT
    port = free_port()
    cfg = Path(tmp) / "sluice.toml"
    cfg.write_text(f"""
[server]
host = "127.0.0.1"
port = {port}
[engine]
kv_cache_tokens = 2048
[tiers.pro]
priority = 0
[tiers.standard]
priority = 1
[[providers]]
name = "mock"
base_url = "{mock}"
api_key_env = "BENCH_MOCK_KEY"
models = {{ "{MODEL}" = "up-model" }}
input_price_per_m = 0.15
output_price_per_m = 0.60
timeout_s = 30
max_concurrent = 512
""")
    env = {"OMP_WAIT_POLICY": "PASSIVE", "SLUICE_AUTH__KEYS_FILE": f"{tmp}/keys.json",
           "BENCH_MOCK_KEY": "sk-mock", "PYTHONPATH": str(root), **(extra_env or {})}
    keys = Path(tmp) / "keys.json"
    if keyed and not keys.exists():
        out = subprocess.run([python or sys.executable, "-m", "gateway.cli", "keys", "create", "--config", str(cfg),
                              "--keys-file", str(keys), "--name", "bench", "--tier", "standard"],
                             cwd=root, env={**os.environ, **env}, capture_output=True, text=True, check=True)
        (Path(tmp) / "key.txt").write_text(out.stdout.strip().splitlines()[-1])
    elif not keyed and keys.exists():
        keys.unlink()
    p = start([python or sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)], env=env,
              log=f"{tmp}/sluice.log", cwd=root)
    # /ready, not /health: the engine loads in the background, and its load (and the gc.freeze the router
    # does once it is loaded, within a second) must not be billed to the first rows' requests.
    wait_ready(f"http://127.0.0.1:{port}/ready", proc=p)
    time.sleep(1.5)
    return p, f"http://127.0.0.1:{port}/v1"


def sluice_token(tmp: str) -> str:
    """The bearer token for the gateway started by `start_sluice(..., keyed=True)`, else any string."""
    f = Path(tmp) / "key.txt"
    return f.read_text().strip() if f.exists() else LITELLM_KEY


def start_litellm(mock: str, tmp: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = Path(tmp) / "litellm.yaml"
    cfg.write_text(f"""
model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/up-model
      api_base: {mock}
      api_key: sk-mock
""")
    p = start([str(LITELLM), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)],
              # the bundled cost map: no fetch from GitHub at start (retries for seconds offline)
              env={"LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
              log=f"{tmp}/litellm.log")
    wait_ready(f"http://127.0.0.1:{port}/health/liveliness", timeout=180, proc=p)
    return p, f"http://127.0.0.1:{port}/v1"


async def one(s: aiohttp.ClientSession, base: str, model: str, stream: bool, rec: dict,
              token: str = LITELLM_KEY) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 16}
    if stream:
        body["stream"] = True
    t0 = time.perf_counter()
    async with s.post(base + "/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}) as r:
        if r.status != 200:
            await r.read()
            rec["errors"].append(time.perf_counter() - t0)
            return
        if not stream:
            await r.read()
        else:
            first = last = None
            async for line in r.content:
                if line.startswith(b"data: {") and CONTENT.search(line):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        rec["itl"].append(now - last)
                    last = now
                    rec["chunks"] += 1
            if first is not None:
                rec["ttft"].append(first - t0)
    rec["lat"].append(time.perf_counter() - t0)


async def run_load(base: str, model: str, stream: bool, conc: int, seconds: float, pid: int | None,
                   grace: float, token: str = LITELLM_KEY) -> dict:
    rec: dict = {"lat": [], "ttft": [], "itl": [], "errors": [], "chunks": 0}
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        # warm-up (connections, first-request costs)
        await asyncio.gather(*[one(s, base, model, stream, {"lat": [], "ttft": [], "itl": [], "errors": [],
                                                             "chunks": 0}, token) for _ in range(min(conc, 8))])
        stop_at = time.perf_counter() + seconds
        cpu0 = cpu_seconds(pid) if pid else 0.0
        client0 = time.process_time()
        t0 = time.perf_counter()

        async def loop() -> None:
            while time.perf_counter() < stop_at:
                try:
                    await one(s, base, model, stream, rec, token)
                except Exception:
                    rec["errors"].append(0.0)

        tasks = [asyncio.create_task(loop()) for _ in range(conc)]
        done, pending = await asyncio.wait(tasks, timeout=seconds + grace)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - t0
        cpu = (cpu_seconds(pid) - cpu0) if pid else 0.0
        client_cpu = time.process_time() - client0
    n = len(rec["lat"])
    return {"n": n, "rps": n / elapsed, "p50": pct(rec["lat"], 50) * 1e3, "p99": pct(rec["lat"], 99) * 1e3,
            "ttft50": pct(rec["ttft"], 50) * 1e3, "ttft99": pct(rec["ttft"], 99) * 1e3,
            "itl50": pct(rec["itl"], 50) * 1e3, "itl99": pct(rec["itl"], 99) * 1e3, "itl_mean": mean(rec["itl"]) * 1e3,
            "errors": len(rec["errors"]), "err_p50": pct(rec["errors"], 50) * 1e3 if rec["errors"] else float("nan"),
            "unfinished": len(pending), "cpu_ms": cpu * 1e3 / max(1, n + len(rec["errors"])),
            # the load generator's own CPU per request: when it nears a core, it (not the target) is the limit
            "client_cpu_ms": client_cpu * 1e3 / max(1, n + len(rec["errors"])), "client_cpu_util": client_cpu / elapsed,
            "cpu_ms_chunk": cpu * 1e3 / max(1, rec["chunks"]) if stream else float("nan")}


GOALS = {"cpu_json": 0.6, "cpu_stream": 1.0, "x_litellm": 15.0, "added_p50_c1_json": 1.0}


def summary(results: dict, concs: list[int], modes: list[str]) -> list[str]:
    """The gateway's overhead goals against this run's rows (absent rows are skipped)."""
    out = ["# summary against the gateway's overhead goals"]

    def ok(good: bool) -> str:
        return "ok  " if good else "MISS"

    for mode in modes:
        goal = GOALS["cpu_json" if mode == "json" else "cpu_stream"]
        for c in (64, 256):
            r = results.get(("sluice", mode, c))
            if r is None:
                continue
            ll = results.get(("litellm", mode, c))
            line = f"{ok(r['cpu_ms'] <= goal)} sluice {mode:6} c={c:<4} cpu/req {r['cpu_ms']:6.3f} ms (goal <= {goal})"
            if ll is not None and ll["rps"] > 0:
                x = r["rps"] / ll["rps"]
                cpu_x = ll["cpu_ms"] / r["cpu_ms"] if r["cpu_ms"] > 0 else float("nan")
                line += (f"   {ok(x >= GOALS['x_litellm'])} req/s {x:5.1f}x LiteLLM's (goal >= {GOALS['x_litellm']:g}x;"
                         f" cpu/req {cpu_x:4.1f}x less)")
            out.append(line)
    r, d = results.get(("sluice", "json", 1)), results.get(("direct", "json", 1))
    if r is not None and d is not None:
        add = r["p50"] - d["p50"]
        out.append(f"{ok(add <= GOALS['added_p50_c1_json'])} sluice json   c=1    added p50 {add:+6.2f} ms "
                   f"(goal <= {GOALS['added_p50_c1_json']:g} ms)")
    return out


def fmt(name: str, mode: str, c: int, r: dict, direct: dict | None) -> str:
    add50 = r["p50"] - direct["p50"] if direct else float("nan")
    add99 = r["p99"] - direct["p99"] if direct else float("nan")
    return (f"{name:8} {mode:6} c={c:<4} {r['rps']:8.1f} req/s  p50 {r['p50']:8.1f}  p99 {r['p99']:9.1f} ms  "
            f"added p50 {add50:+7.1f} p99 {add99:+8.1f}  ttft50 {r['ttft50']:7.1f}  cpu/req {r['cpu_ms']:6.2f} ms"
            f"  cpu/chunk {r['cpu_ms_chunk']:5.3f}  err {r['errors']} (p50 {r['err_p50']:.1f} ms) unfinished {r['unfinished']}"
            f"  [client {r['client_cpu_util'] * 100:3.0f}% cpu]")


async def main_async(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="sluice-remote-bench-")
    procs = []
    try:
        genv = dict(kv.split("=", 1) for kv in args.gateway_env)
        groot = Path(args.gateway_root).resolve() if args.gateway_root else None
        if groot is not None and "PYTHONPATH" in genv:
            genv["PYTHONPATH"] = f"{groot}:{genv['PYTHONPATH']}"
        mock_p, mock = start_mock()
        procs.append(mock_p)
        targets = [("direct", mock, mock_p.pid, "up-model", LITELLM_KEY)]
        sl_p, sl = start_sluice(mock, tmp, extra_env=genv, python=args.gateway_python, keyed=args.keyed,
                                root=groot)
        procs.append(sl_p)
        targets.append(("sluice", sl, sl_p.pid, MODEL, sluice_token(tmp)))
        if not args.no_litellm and LITELLM.exists():
            ll_p, ll = start_litellm(mock, tmp)
            procs.append(ll_p)
            targets.append(("litellm", ll, ll_p.pid, MODEL, LITELLM_KEY))
        elif not args.no_litellm:
            print("# LiteLLM not installed (bench/setup_litellm.sh); skipping it", flush=True)
        concs = [int(c) for c in args.concurrency.split(",")]
        modes = args.modes.split(",")
        results: dict = {}
        print(f"# zero-latency mock, 16 tokens per answer, {args.seconds}s closed loop per row; cpu = the "
              f"target process (direct: the mock itself); sluice {'keyed' if args.keyed else 'anonymous'}"
              + (f", gateway env {genv}" if genv else "") + (f", gateway python {args.gateway_python}"
                                                          if args.gateway_python else "")
              + (f", gateway tree {groot}" if groot else ""), flush=True)
        for mode in modes:
            for c in concs:
                for name, base, pid, model, token in targets:
                    r = await run_load(base, model, mode == "stream", c, args.seconds, pid, args.grace, token)
                    results[(name, mode, c)] = r
                    print(fmt(name, mode, c, r, results.get(("direct", mode, c)) if name != "direct" else None),
                          flush=True)
        for line in summary(results, concs, modes):
            print(line, flush=True)
        results_file = Path(tmp) / "results.json"
        results_file.write_text(json.dumps({f"{k[0]}/{k[1]}/{k[2]}": v for k, v in results.items()}, indent=1))
        if args.no_fidelity:
            print(f"# raw results: {results_file}")
            return
        # relay fidelity: upstream tokens 20 ms apart
        stop(mock_p)
        for p in procs[1:]:
            stop(p)
        procs = []
        mock_p, mock = start_mock(itl_ms=args.itl_ms, tokens=16)
        procs.append(mock_p)
        sl_p, sl = start_sluice(mock, tmp, extra_env=genv, python=args.gateway_python, keyed=args.keyed,
                                root=groot)
        procs.append(sl_p)
        fid = [("direct", mock, "up-model", LITELLM_KEY), ("sluice", sl, MODEL, sluice_token(tmp))]
        if not args.no_litellm and LITELLM.exists():
            ll_p, ll = start_litellm(mock, tmp)
            procs.append(ll_p)
            fid.append(("litellm", ll, MODEL, LITELLM_KEY))
        print(f"# relay fidelity: upstream sends a token every {args.itl_ms} ms", flush=True)
        for c in (1, 64):
            for name, base, model, token in fid:
                r = await run_load(base, model, True, c, args.seconds, None, args.grace, token)
                print(f"{name:8} stream c={c:<4} inter-token p50 {r['itl50']:6.2f} mean {r['itl_mean']:6.2f} "
                      f"p99 {r['itl99']:6.2f} ms  ttft50 {r['ttft50']:6.1f} ms  n={r['n']}", flush=True)
        print(f"# raw results: {results_file}")
    finally:
        for p in procs:
            stop(p)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--grace", type=float, default=20.0, help="after --seconds, wait this long for in-flight")
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--no-litellm", action="store_true")
    p.add_argument("--modes", default="json,stream")
    p.add_argument("--no-fidelity", action="store_true", help="skip the relay-fidelity pass (--itl-ms)")
    p.add_argument("--keyed", action="store_true", help="Sluice in key mode (a created key), not anonymous")
    p.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for the Sluice process (repeatable)")
    p.add_argument("--gateway-python", default=None, help="interpreter for the Sluice process")
    p.add_argument("--gateway-root", default=None, help="run Sluice from another source tree (a modified copy)")
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
