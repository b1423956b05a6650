"""A Responses chain and the prefix cache: 4-turn conversations with a ~1,000-token system prompt
(`instructions`), each turn continuing the last with `previous_response_id`, against a fresh
`sluice serve`. Time to the first output_text delta of each turn, streamed: turns 2-4 render the
earlier turns the same way, so their prefill starts where the cache ends. Each chain has its own
instructions (no chain hits another's cache). Goal: TTFT of turns 2-4 <= 0.3x turn 1's.

    python -m bench.responses_chain [--chains 5] [--system-tokens 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from bench.server import sluice_server_process
from bench.structured import cpu_model

QUESTIONS = ["What should I pack first?", "And the fragile items?", "How do I label the boxes?",
             "Anything else before the truck comes?"]


def turn(client: openai.OpenAI, model: str, instructions: str, question: str,
         previous: str | None) -> tuple[float, str, int]:
    """(TTFT in seconds, response id, cached input tokens) of one streamed turn."""
    t0 = time.perf_counter()
    ttft = None
    rid = None
    with client.responses.stream(model=model, instructions=instructions, input=question, max_output_tokens=24,
                                 temperature=0, previous_response_id=previous) as s:
        for e in s:
            if e.type == "response.created":
                rid = e.response.id
            if ttft is None and e.type == "response.output_text.delta":
                ttft = time.perf_counter() - t0
    assert ttft is not None and rid is not None
    got = client.responses.retrieve(rid)
    return ttft, rid, got.usage.input_tokens_details.cached_tokens if got.usage else 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chains", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1000)
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_model()}")
    with sluice_server_process() as (url, _):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        per_turn: list[list[float]] = [[] for _ in QUESTIONS]
        cached: list[list[int]] = [[] for _ in QUESTIONS]
        for c in range(args.chains):
            words = " ".join(f"rule{c}-{i}: keep the boxes dry and stacked." for i in range(args.system_tokens // 12))
            instructions = f"You are a moving-day assistant (chain {c}). Follow these rules. {words}"
            previous = None
            for t, q in enumerate(QUESTIONS):
                ttft, previous, hit = turn(client, model, instructions, q, previous)
                per_turn[t].append(ttft)
                cached[t].append(hit)
        first = statistics.median(per_turn[0])
        print(f"{args.chains} chains of {len(QUESTIONS)} turns, ~{args.system_tokens}-token instructions")
        for t in range(len(QUESTIONS)):
            med = statistics.median(per_turn[t])
            print(f"  turn {t + 1}: TTFT p50 {med * 1e3:7.1f} ms  ({med / first:.2f}x turn 1)  "
                  f"cached input tokens p50 {statistics.median(cached[t]):.0f}")
        worst = max(statistics.median(per_turn[t]) for t in range(1, len(QUESTIONS))) / first
        print(f"turns 2-{len(QUESTIONS)} worst: {worst:.2f}x turn 1 (goal <= 0.3x)")


if __name__ == "__main__":
    main()
