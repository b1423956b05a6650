"""`deterministic = true`: a request's logits, and so its greedy output, are bit-identical whatever the
prefix-cache state, the chunking of its prefill and the other requests batched with it.

The default path is not: its matmuls round a row differently with the batch size (the last bit in
float32; visibly with bf16 weights, where a cold and a warm request can pick different tokens).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler

pytestmark = pytest.mark.model

SYSTEM = ("You are the support assistant of Sluice, a gateway that batches chat requests on a local engine, "
          "caches shared prompt prefixes and sends overflow to remote providers. Answer briefly. ") * 2
QUESTIONS = ["What does Sluice cache?", "Where does overflow go?", "Name a colour.", "Count to five."]
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=["auto", "bfloat16"])
def det_engine(request):
    """auto: float32 weights under deterministic; bfloat16: the cheaper weights, batch-invariant too."""
    return LLMEngine(EngineConfig(kv_cache_tokens=4096, max_running_requests=8, deterministic=True,
                                  weight_dtype=request.param))


def request(engine, rid: str, question: str, max_tokens: int = MAX_TOKENS) -> EngineRequest:
    ids = engine.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": question}])
    return EngineRequest(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def run(engine, reqs, monkeypatch, fresh_cache: bool, **config) -> dict[str, tuple[list[int], list[torch.Tensor], int]]:
    """Generates `reqs` together; returns each request's tokens, the logits it sampled from, and its cached tokens."""
    if fresh_cache or config:
        engine.config = dataclasses.replace(engine.config, **config)
        if fresh_cache:
            engine.block_manager = BlockManager(engine.runner.num_blocks, engine.config.block_size, True)
        engine.scheduler = Scheduler(engine.config, engine.block_manager)
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    forward = engine.runner._forward

    def recording_forward(scheduled, all_logits=False):
        out, hidden, samplers = forward(scheduled, all_logits)
        for i, seq in enumerate(samplers):
            logits[seq.request_id].append(out[i].clone())
        return out, hidden, samplers

    monkeypatch.setattr(engine.runner, "_forward", recording_forward)
    res = engine.generate(reqs)
    monkeypatch.setattr(engine.runner, "_forward", forward)
    return {r.request_id: ([t for o in res[r.request_id] for t in o.token_ids], logits[r.request_id],
                           res[r.request_id][-1].cached_tokens) for r in reqs}


def test_deterministic_outputs_ignore_cache_state_and_batching(det_engine, monkeypatch):
    engine = det_engine
    saved = (engine.config, engine.block_manager, engine.scheduler)
    try:
        base = dict(chunked_prefill_size=256, max_num_batched_tokens=512)
        # Cold: an empty prefix cache, each request alone, its prompt in one prefill.
        cold = {}
        for i, q in enumerate(QUESTIONS):
            cold[i] = run(engine, [request(engine, f"cold{i}", q)], monkeypatch, fresh_cache=True, **base)[f"cold{i}"]
            assert cold[i][2] == 0
        # Warm: the shared system prompt is cached by the previous request (and then the whole prompt).
        run(engine, [request(engine, "warmup", "Hello there.")], monkeypatch, fresh_cache=True, **base)
        for i, q in enumerate(QUESTIONS):
            for again in range(2 if i == 0 else 1):  # again: the whole prompt cached (one question shows it)
                got = run(engine, [request(engine, f"warm{i}-{again}", q)], monkeypatch, fresh_cache=False)
                tokens, logits, cached = got[f"warm{i}-{again}"]
                assert cached >= 64
                assert tokens == cold[i][0]
                assert all(torch.equal(a, b) for a, b in zip(logits, cold[i][1], strict=True)), \
                    f"question {i}: logits differ between a cold and a warm prefix cache"
        # Batched: all four at once (and two longer ones), prefill chunked into small pieces that share
        # steps with the others' decodes, from an empty cache.
        reqs = [request(engine, f"batch{i}", q) for i, q in enumerate(QUESTIONS)]
        reqs += [request(engine, "long0", "Write a long story.", 12), request(engine, "long1", "Why?", 3)]
        got = run(engine, reqs, monkeypatch, fresh_cache=True, chunked_prefill_size=24, max_num_batched_tokens=40)
        assert engine.stats.steps > 0
        for i in range(len(QUESTIONS)):
            tokens, logits, _ = got[f"batch{i}"]
            assert tokens == cold[i][0]
            assert all(torch.equal(a, b) for a, b in zip(logits, cold[i][1], strict=True)), \
                f"question {i}: logits differ between running alone and in a chunked batch"
    finally:
        engine.config, engine.block_manager, engine.scheduler = saved


def test_deterministic_mode_computes_in_float32_without_graphs_or_the_fast_head(det_engine):
    want = torch.float32 if det_engine.config.weight_dtype == "auto" else torch.bfloat16
    assert det_engine.runner.weight_dtype == want and det_engine.runner.dtype == torch.float32
    assert det_engine.runner.graphs is None and det_engine.runner.model.lm_head_fast is None
