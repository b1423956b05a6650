"""Stop strings are never emitted, even split across tokens; finish reasons are right."""

import pytest

from engine.output import OutputProcessor
from engine.request import EngineRequest, SamplingParams
from engine.sequence import Sequence

pytestmark = pytest.mark.model


def run_tokens(tokenizer, text, stop, max_tokens=1000, eos=(2,)):
    ids = tokenizer.encode(text)
    seq = Sequence.from_request(EngineRequest("r", tokenizer.encode("Hi"), SamplingParams(stop=stop)), max_tokens)
    proc = OutputProcessor(seq, tokenizer, list(eos))
    outs = []
    for t in ids:
        out = proc.on_token(t)
        if out is not None:
            outs.append(out)
        if seq.finish_reason:
            break
    return outs, seq


@pytest.mark.parametrize("stop", [["STOP"], ["\n\n"], ["ld, th"], ["xyz", "is a"]])
def test_stop_string_cut_and_never_emitted(tokenizer, stop):
    text = "Hello world, this is a STOP sign.\n\nMore text"
    outs, seq = run_tokens(tokenizer, text, stop)
    emitted = "".join(o.text for o in outs)
    first = min(text.find(s) for s in stop if s in text)
    assert emitted == text[:first]
    assert seq.finish_reason == "stop"
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    for s in stop:
        assert s not in emitted


def test_stop_string_split_across_tokens(tokenizer):
    # "<END>" is several tokens: no prefix of it may leak out before it completes.
    text = "abc <END> tail"
    ids = tokenizer.encode(text)
    assert len(tokenizer.encode("<END>")) > 1
    outs, seq = run_tokens(tokenizer, text, ["<END>"])
    assert "".join(o.text for o in outs) == "abc "
    assert len(ids) > len(outs)


def test_partial_stop_prefix_released_when_ruled_out(tokenizer):
    outs, seq = run_tokens(tokenizer, "a <EN b", ["<END>"], max_tokens=len(tokenizer.encode("a <EN b")))
    assert "".join(o.text for o in outs) == "a <EN b"
    assert seq.finish_reason == "length"


def test_max_tokens_gives_length(tokenizer):
    outs, seq = run_tokens(tokenizer, "one two three four five six", [], max_tokens=3)
    assert seq.finish_reason == "length"
    assert outs[-1].completion_tokens == 3
