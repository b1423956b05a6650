"""The encoder engine's loop on all-MiniLM-L6-v2: refusals at add_request (naming the field and the
input), truncation, one output per input with the request's last one finished, a vector independent of
the inputs it shares a step with, a query served within one step of a big request, abort, shortened
vectors where the model supports them, and a failing step that takes only its own request down."""

from __future__ import annotations

import pytest
import torch

from engine import EmbeddingConfig, EmbeddingEngine, EmbeddingOutput, EmbeddingRequest, RequestRejected

pytestmark = pytest.mark.model

SENTENCES = ["Where is the station?", "A short one.", " ".join(["long passage about rivers and stones"] * 30),
             "Embeddings map text to vectors.", "x"]


def run(engine, *reqs: EmbeddingRequest) -> dict[str, list[EmbeddingOutput]]:
    for r in reqs:
        engine.add_request(r)
    outs: dict[str, list[EmbeddingOutput]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def vectors(outs: list[EmbeddingOutput]) -> dict[int, torch.Tensor]:
    return {o.index: torch.tensor(o.embedding) for o in outs}


@pytest.mark.parametrize("inputs, truncate, code, words", [
    ([], False, "invalid_request", "empty"),
    ([[101, 102], []], False, "invalid_request", "input 1 is empty"),
    ([[101, 102], [101, 30522, 102]], False, "invalid_request", "input 1: token id 30522"),
    ([[101, 102], [101] + [2000] * 300 + [102]], False, "context_length_exceeded", "input 1 has 302 tokens"),
])
def test_bad_inputs_are_refused_naming_the_input(embedding_engine, inputs, truncate, code, words):
    with pytest.raises(RequestRejected, match=words) as e:
        embedding_engine.add_request(EmbeddingRequest("bad", inputs, truncate=truncate))
    assert (e.value.code, e.value.param) == (code, "input")
    assert not embedding_engine.has_unfinished()


def test_dimensions_are_refused_where_the_model_does_not_support_them(embedding_engine):
    assert embedding_engine.supports_dimensions is False
    with pytest.raises(RequestRejected, match="does not support dimensions") as e:
        embedding_engine.add_request(EmbeddingRequest("d", [[101, 102]], dimensions=64))
    assert e.value.param == "dimensions"


def test_a_running_request_id_is_refused(embedding_engine):
    embedding_engine.add_request(EmbeddingRequest("twice", [[101, 102]]))
    try:
        with pytest.raises(RequestRejected) as e:
            embedding_engine.add_request(EmbeddingRequest("twice", [[101, 102]]))
        assert e.value.code == "duplicate_request"
    finally:
        embedding_engine.abort("twice")


def test_truncate_cuts_as_the_tokenizer_does(embedding_engine):
    text = " ".join(["the river runs past the old mill"] * 60)
    full, = embedding_engine.tokenize([text])
    cut, = embedding_engine.tokenize([text], truncate=True)
    assert len(full) > 256 and len(cut) == 256 == embedding_engine.max_input_tokens
    outs = run(embedding_engine, EmbeddingRequest("long", [full], truncate=True), EmbeddingRequest("cut", [cut]))
    assert outs["long"][0].prompt_tokens == 256
    torch.testing.assert_close(vectors(outs["long"])[0], vectors(outs["cut"])[0])


def test_one_output_per_input_the_last_one_finished(embedding_engine):
    ids = embedding_engine.tokenize(SENTENCES)
    outs = run(embedding_engine, EmbeddingRequest("r", ids))["r"]
    assert sorted(o.index for o in outs) == list(range(len(SENTENCES)))
    assert [o.finished for o in outs] == [False] * (len(SENTENCES) - 1) + [True]
    assert {o.index: o.prompt_tokens for o in outs} == {i: len(x) for i, x in enumerate(ids)}
    assert all(len(o.embedding) == embedding_engine.dimensions == 384 for o in outs)
    assert EmbeddingOutput.from_dict(outs[0].to_dict()) == outs[0]
    req = EmbeddingRequest("q", ids, priority=3, truncate=True)
    assert EmbeddingRequest.from_dict(req.to_dict()) == req


@pytest.mark.parametrize("dtype, floor", [("float32", 0.99999), ("bfloat16", 0.9995)])
def test_a_vector_does_not_depend_on_the_inputs_sharing_its_step(dtype, floor):
    """float32: equal to rounding (measured 0.99999994). bf16 rounds every product and the residual to 8
    bits, and where a step's shape changes the matmul's blocking the rounding moves: measured 0.99993,
    as far as bf16 is from float32 anyway (the floor leaves room for other CPUs' kernels)."""
    engine = EmbeddingEngine(EmbeddingConfig(dtype=dtype))
    ids = engine.tokenize(SENTENCES)
    alone = {i: vectors(run(engine, EmbeddingRequest(f"alone{i}", [x]))[f"alone{i}"])[0] for i, x in enumerate(ids)}
    mixed = run(engine, EmbeddingRequest("a", ids[:3]), EmbeddingRequest("b", ids[3:]))
    together = {**vectors(mixed["a"]), **{i + 3: v for i, v in vectors(mixed["b"]).items()}}
    for i in alone:
        assert torch.dot(alone[i], together[i]) > floor


def test_a_query_added_after_a_big_request_is_served_within_one_step(embedding_engine, monkeypatch):
    monkeypatch.setattr(embedding_engine.scheduler, "max_batch_tokens", 256)
    bulk = embedding_engine.tokenize([f"document number {i} about the river and its stones" for i in range(200)])
    embedding_engine.add_request(EmbeddingRequest("bulk", bulk, priority=1))
    first = embedding_engine.step()
    assert {o.request_id for o in first} == {"bulk"} and 0 < len(first) < 200
    embedding_engine.add_request(EmbeddingRequest("query", embedding_engine.tokenize(["where is it?"]), priority=0))
    nxt = embedding_engine.step()
    assert [(o.request_id, o.finished) for o in nxt] == [("query", True)]
    rest = []  # the bulk request goes on where it was
    while embedding_engine.has_unfinished():
        rest += embedding_engine.step()
    assert sorted(o.index for o in first + rest) == list(range(200)) and rest[-1].finished


def test_abort_drops_what_is_left_of_a_request(embedding_engine, monkeypatch):
    monkeypatch.setattr(embedding_engine.scheduler, "max_batch_tokens", 256)
    ids = embedding_engine.tokenize([f"item {i} of a long list" for i in range(100)])
    embedding_engine.add_request(EmbeddingRequest("gone", ids))
    got = embedding_engine.step()
    embedding_engine.abort("gone")
    assert not embedding_engine.has_unfinished() and embedding_engine.step() == []
    assert not any(o.finished for o in got)


def test_shortened_vectors_where_the_model_supports_them(embedding_engine, monkeypatch):
    monkeypatch.setattr(embedding_engine, "supports_dimensions", True)
    ids = embedding_engine.tokenize(SENTENCES[:2])
    with pytest.raises(RequestRejected, match="between 1 and 384"):
        embedding_engine.add_request(EmbeddingRequest("big", ids, dimensions=385))
    outs = run(embedding_engine, EmbeddingRequest("short", ids, dimensions=64), EmbeddingRequest("full", ids))
    short, full = vectors(outs["short"]), vectors(outs["full"])
    for i in short:
        assert short[i].shape == (64,)
        torch.testing.assert_close(short[i], torch.nn.functional.normalize(full[i][:64], dim=0))


def test_a_failing_step_takes_only_its_own_request_down(embedding_engine, monkeypatch):
    poison = 1999
    real = embedding_engine.embed_ids

    def embed_ids(inputs):
        if any(poison in ids for ids in inputs):
            raise RuntimeError("boom")
        return real(inputs)

    monkeypatch.setattr(embedding_engine, "embed_ids", embed_ids)
    outs = run(embedding_engine, EmbeddingRequest("good", [[101, 2000, 102]] * 2),
               EmbeddingRequest("bad", [[101, poison, 102], [101, 2001, 102]]))
    assert sorted(o.index for o in outs["good"]) == [0, 1] and outs["good"][-1].finished
    assert [(o.index, o.finished) for o in outs["bad"]] == [(-1, True)] and "RuntimeError" in outs["bad"][0].error
    assert not embedding_engine.has_unfinished()
