"""The queue's fill/time batching knobs (`queue.fill_target`, `queue.max_wait_ms`) for embeddings: one-input
requests from many clients at once (`sluice bench --endpoint embeddings --inputs-per-request 1`) against
a gateway serving all-MiniLM-L6-v2 alone, for each setting in turn, on one machine in one run.

The encoder engine batches whatever its worker has pulled (its scheduler packs the inputs of every
pending request into one forward), so a pull that waits for more items only adds that wait to each
request's latency unless it lets the engine fill forwards it could not fill otherwise; this measures it.

    python -m bench.embeddings_queue [--settings 1:0,8:5,32:20] [--concurrency 1,32] [--requests 480]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.server import ROOT, sluice_server_process

EMB = "all-MiniLM-L6-v2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="1:0,8:5,32:20", help="fill_target:max_wait_ms pairs")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--requests", type=int, default=480)
    args = ap.parse_args()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((ln for ln in lscpu.splitlines() if ln.startswith("Model name")), ""), flush=True)
    rows = []
    for pair in args.settings.split(","):
        fill, wait = pair.split(":")
        env = {"SLUICE_QUEUE__FILL_TARGET": fill, "SLUICE_QUEUE__MAX_WAIT_MS": wait,
               "SLUICE_MODELS": json.dumps([{"id": EMB, "kind": "embedding"}])}
        out = Path(tempfile.mkdtemp(prefix="sluice-bench-q-")) / "run.json"
        with sluice_server_process(env) as (url, _):
            run = subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "--base-url", url, "--endpoint",
                            "embeddings", "--model", EMB, "--inputs-per-request", "1", "--input-len", "uniform:8:64", "--concurrency",
                            args.concurrency, "--requests", str(args.requests), "--json", str(out)],
                           cwd=ROOT, capture_output=True, text=True)
            if not out.is_file():
                raise SystemExit(f"sluice bench failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        for level in json.loads(out.read_text())["levels"]:
            s = level["summary"]
            rows.append((fill, wait, level["level"]["label"], s["input_rate"], s["e2e_ms"]["p50"], s["e2e_ms"]["p99"]))
    print(f"{'fill_target':>11} {'max_wait_ms':>11} {'level':>15} {'inputs/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for fill, wait, level, rate, p50, p99 in rows:
        print(f"{fill:>11} {wait:>11} {str(level):>15} {rate or 0:>9.1f} {p50 or 0:>8.1f} {p99 or 0:>8.1f}")


if __name__ == "__main__":
    main()
