"""The CUDA-only pieces, checked on the CPU: graph-bucket padding and the device sampler (with the logit
controls, grammar masks and logprobs it shares with the CPU sampler)."""

import pytest
import torch

from engine import EngineRequest, SamplingParams
from engine.cuda_graphs import DecodeGraphs
from engine.sampler import sample_on_device

pytestmark = pytest.mark.model


def test_padded_decode_bucket_gives_the_same_logits_as_eager(engine):
    runner = engine.runner
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Count to {i}."}])
               for i in range(3, 8)]
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"g{i}", ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    for _ in range(3):
        engine.step()  # prefill, then a couple of decodes
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 5 and all(not s.is_prefilling for s in seqs)
    step = {s: 1 for s in seqs}
    before = [s.num_computed_tokens for s in seqs]
    eager, eager_h, _ = runner._forward_eager(step)
    assert [s.num_computed_tokens for s in seqs] == before  # the runner only reads sequences
    # Rerun the same step through the padded graph path: it writes the same K/V to the same slots.
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.block_size, 64, runner.scratch_block, max_batch=8,
                          max_model_len=engine.max_model_len, capture=False)
    assert graphs.bucket_for(5) == 8  # three padding rows
    runner.graphs = graphs
    try:
        padded, padded_h, order = runner._forward_graph(step)
    finally:
        runner.graphs = None
    assert order == seqs
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded_h, eager_h, rtol=1e-4, atol=1e-4)  # exact logprob rows start from these
    assert [s.num_computed_tokens for s in seqs] == before
    for i in range(len(prompts)):
        engine.abort(f"g{i}")


def test_device_sampler_is_greedy_at_zero_and_seeded_independent_of_batch(engine):
    from engine.sequence import Sequence

    def seq(rid, temp, seed=None, outputs=0):
        sp = SamplingParams(temperature=temp, seed=seed, top_p=0.9)
        s = Sequence.from_request(EngineRequest(rid, [1, 2, 3], sp), 8)
        s.output_token_ids = [5] * outputs
        return s

    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    a = [seq("a", 0.0), seq("b", 1.0, seed=42), seq("c", 0.7), seq("d", 1.0, seed=42, outputs=3)]
    out = sample_on_device(logits, a).tolist()
    assert out[0] == int(logits[0].argmax())
    again = sample_on_device(logits[1:2], [seq("b2", 1.0, seed=42)]).tolist()
    assert again == [out[1]]  # same seed and index, same token, alone or in a batch
    diff_index = [sample_on_device(logits[1:2], [seq("e", 1.0, seed=42, outputs=k)]).item() for k in range(8)]
    assert len(set(diff_index)) > 1  # the noise moves on with the token index


def test_an_all_greedy_batch_takes_the_argmax_without_drawing_noise(monkeypatch):
    import kernels.sampling
    from engine.sequence import Sequence

    def no_noise(*_a, **_k):
        raise AssertionError("a greedy batch drew the race's noise")

    seqs = [Sequence.from_request(EngineRequest(f"g{i}", [1, 2, 3], SamplingParams(temperature=0)), 8)
            for i in range(3)]
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(kernels.sampling, "uniform_noise", no_noise)
    assert sample_on_device(logits, seqs).tolist() == logits.argmax(-1).tolist()
    seqs.append(Sequence.from_request(EngineRequest("t", [1, 2, 3], SamplingParams(temperature=1.0, seed=3)), 8))
    with pytest.raises(AssertionError, match="noise"):  # one sampled row: the race, for every row
        sample_on_device(torch.cat([logits, logits[:1]]), seqs)


def test_device_sampler_applies_controls_and_grammar_masks_per_row(engine):
    import json

    from engine.request import Guide
    from engine.sampler import sample
    from engine.sequence import Sequence

    def seq(rid, **sp):
        s = Sequence.from_request(EngineRequest(rid, [1, 2, 3], SamplingParams(**sp)), 8, eos_token_ids=[2])
        if s.sampling.guide is not None:
            s.guide = engine.guides.matcher(s.sampling.guide, [])
        return s

    torch.manual_seed(0)
    vocab = engine.runner.model.args.vocab_size
    logits = torch.randn(4, vocab)
    top = int(logits[1].argmax())
    schema = Guide("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    seqs = [seq("free", temperature=0), seq("bias", temperature=0, logit_bias={top: -100.0}),
            seq("json", temperature=0, guide=schema), seq("json_t", temperature=1.0, seed=5, guide=schema)]
    out = sample_on_device(logits, seqs, engine.guides).tolist()
    assert out[0] == int(logits[0].argmax())
    assert out[1] != top and out[1] == int(logits[1].topk(2).indices[1])
    assert engine.tokenizer.decode([out[2]]).startswith("{") and engine.tokenizer.decode([out[3]]).startswith("{")
    # The CPU sampler's controls are the same functions and its noise the same: every row agrees.
    host = [s.token for s in sample(logits, seqs, engine.guides, engine.runner.kernels)]
    assert host == out
