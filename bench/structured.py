"""Constrained decoding's cost: output tokens/s with every request guided by a JSON schema against the
same requests unconstrained, on the engine alone (no HTTP), at a fixed concurrency.

The constrained run goes first; the unconstrained run then generates exactly as many tokens per request
(`ignore_eos`, `max_tokens` = that request's constrained length), so both runs do the same model work
and the ratio is what the grammar costs: computing each guided row's token mask on the host, applying it,
and advancing the matcher. Also printed: schema compile time per new schema (the first one also builds
llguidance's tokenizer) and the per-token mask time (p50/p90 over steps).

Both runs see the same warm prefix cache (every prompt is prefilled once first), and they alternate
`--repeats` times; the best of each is compared. On a shared machine wall-clock rates swing with other
processes' load, so the rate per CPU-second of this process (all its threads) is printed too: it
counts only the work done, and its ratio is the steadier measure of what the grammar costs.

    python -m bench.structured [--requests 32] [--concurrency 16] [--max-tokens 160] [--repeats 2]
                               [--weight-dtype auto]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from bench.common import TOPICS, pct
from engine import EngineConfig, EngineRequest, Guide, LLMEngine, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 160},
        "mood": {"enum": ["calm", "happy", "sad", "tense", "neutral"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "facts": {"type": "array", "maxItems": 4,
                  "items": {"type": "object", "properties": {"fact": {"type": "string", "maxLength": 60},
                                                             "certain": {"type": "boolean"}},
                            "required": ["fact", "certain"], "additionalProperties": False}},
        "source": {"type": "object", "properties": {"kind": {"enum": ["book", "web", "memory"]},
                                                    "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
                   "required": ["kind"], "additionalProperties": False},
    },
    "required": ["title", "summary", "mood", "rating", "facts"],
    "additionalProperties": False,
}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (lscpu failed)"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def run(engine: LLMEngine, reqs: list[EngineRequest],
        concurrency: int) -> tuple[float, float, dict[str, list[int]], dict[str, str], list[float]]:
    """Closed loop: `concurrency` requests in flight, a new one added as one finishes. Returns (wall
    seconds, CPU seconds, token ids and text per request, per-token mask seconds of each step that masked)."""
    pending = list(reqs)
    ids: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    text: dict[str, str] = {r.request_id: "" for r in reqs}
    in_flight = 0
    g = engine.stats.guide
    per_token_mask: list[float] = []
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            engine.add_request(pending.pop(0))
            in_flight += 1
        masks, secs = g.masks, g.mask_seconds
        for out in engine.step():
            ids[out.request_id] += out.token_ids
            text[out.request_id] += out.text
            in_flight -= out.finished
        if g.masks > masks:
            per_token_mask.append((g.mask_seconds - secs) / (g.masks - masks))
    return time.perf_counter() - t0, time.process_time() - c0, ids, text, per_token_mask


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--weight-dtype", default="auto")
    args = ap.parse_args(argv)

    print(f"CPU: {cpu_model()}")
    engine = LLMEngine(EngineConfig(weight_dtype=args.weight_dtype, max_running_requests=max(32, args.concurrency)))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Summarise what you know about {topic} "
                                         f"(note {i}) as a JSON record."}])
               for i, topic in enumerate(TOPICS[i % len(TOPICS)] for i in range(args.requests))]

    # Compile time per new schema: the first compile also builds llguidance's tokenizer from the engine's.
    g = engine.stats.guide
    for i in range(4):
        schema = dict(SCHEMA, properties={**SCHEMA["properties"], f"extra{i}": {"type": "string"}})
        c0, t0 = g.compile_seconds, time.perf_counter()
        engine.add_request(EngineRequest(f"compile{i}", prompts[0], SamplingParams(
            max_tokens=1, guide=Guide("json_schema", json.dumps(schema)))))
        wall = time.perf_counter() - t0
        engine.abort(f"compile{i}")
        print(f"schema compile #{i + 1}: {1e3 * (g.compile_seconds - c0):.2f} ms"
              + (f" (add_request {1e3 * wall:.0f} ms, includes building llguidance's tokenizer)" if i == 0 else ""))

    guide = Guide("json_schema", json.dumps(SCHEMA))
    # Warm the kernels and the prefix cache with every prompt, so both runs start from the same state.
    engine.generate([EngineRequest(f"w{i}", p, SamplingParams(temperature=0, max_tokens=1))
                     for i, p in enumerate(prompts)])

    con_tps: list[float] = []
    free_tps: list[float] = []
    con_cpu: list[float] = []
    free_cpu: list[float] = []
    mask_times: list[float] = []
    n_con = valid = 0
    for rep in range(args.repeats):
        constrained = [EngineRequest(f"c{rep}.{i}", p, SamplingParams(temperature=0.7, seed=i, guide=guide,
                                                                     max_tokens=args.max_tokens))
                       for i, p in enumerate(prompts)]
        wall, cpu, ids_con, text_con, masks = run(engine, constrained, args.concurrency)
        mask_times += masks
        n_con = sum(len(v) for v in ids_con.values())
        valid = sum(_parses(v) for v in text_con.values())
        con_tps.append(n_con / wall)
        con_cpu.append(n_con / cpu)
        # Exactly the same number of tokens per request, unconstrained.
        free = [EngineRequest(f"f{rep}.{i}", p, SamplingParams(temperature=0.7, seed=i, ignore_eos=True,
                                                              max_tokens=max(1, len(ids_con[f"c{rep}.{i}"]))))
                for i, p in enumerate(prompts)]
        wall, cpu, ids_free, _, _ = run(engine, free, args.concurrency)
        n_free = sum(len(v) for v in ids_free.values())
        free_tps.append(n_free / wall)
        free_cpu.append(n_free / cpu)
        print(f"  run {rep + 1}: constrained {con_tps[-1]:.1f} tok/s ({con_cpu[-1]:.1f} per CPU-s), "
              f"unconstrained {free_tps[-1]:.1f} tok/s ({free_cpu[-1]:.1f} per CPU-s)")

    print(f"requests {args.requests}, concurrency {args.concurrency}, weights {engine.runner.weight_dtype}, "
          f"{n_con} output tokens per run ({n_con / args.requests:.0f} per request)")
    print(f"constrained (json_schema): {max(con_tps):8.1f} tok/s  {max(con_cpu):8.1f} tok per CPU-s   "
          f"({valid}/{args.requests} outputs parse as JSON; the rest hit max_tokens)")
    print(f"unconstrained:             {max(free_tps):8.1f} tok/s  {max(free_cpu):8.1f} tok per CPU-s")
    print(f"per-token mask time: p50 {1e6 * pct(mask_times, 50):.0f} us, p90 {1e6 * pct(mask_times, 90):.0f} us "
          f"over {len(mask_times)} steps ({g.masks} masks, {g.mask_seconds:.2f} s in all)")
    print(f"ratio constrained / unconstrained: {max(con_tps) / max(free_tps):.3f}x wall, "
          f"{max(con_cpu) / max(free_cpu):.3f}x per CPU-second (goal >= 0.98x)")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
