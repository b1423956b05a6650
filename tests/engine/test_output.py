"""Stop strings are never emitted, even split across tokens; finish reasons are right."""

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.output import OutputProcessor
from engine.request import EngineRequest, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

pytestmark = pytest.mark.model


def run_tokens(tokenizer, text, stop, max_tokens=1000, eos=(2,)):
    """Feeds the tokens of `text` as if the model sampled them, through the engine's per-token path:
    the scheduler appends and stops on ids/length, the output processor detokenizes and finds stop strings."""
    ids = tokenizer.encode(text)
    req = EngineRequest("r", tokenizer.encode("Hi"), SamplingParams(stop=stop))
    seq = Sequence.from_request(req, max_tokens, eos_token_ids=eos)
    sched = Scheduler(EngineConfig(), BlockManager(256, 16))
    sched.add(seq)
    proc = OutputProcessor(seq, tokenizer)
    outs = []
    for t in ids:
        sched.update_from_output(sched.schedule(), {seq: t})
        if proc.push(t):
            sched.finish(seq, "stop")
        out = proc.output()
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


def test_stop_token_is_not_detokenized(tokenizer):
    eos = tokenizer.encode("Hello there!")[-1]  # "!" plays the end-of-sequence token
    outs, seq = run_tokens(tokenizer, "Hello there! More", [], eos=(eos,))
    assert seq.finish_reason == "stop" and outs[-1].finished
    assert "".join(o.text for o in outs) == "Hello there"
    assert outs[-1].token_ids[-1] == eos


def test_stop_string_wins_over_length_on_the_same_token(tokenizer):
    text = "one two three"
    outs, seq = run_tokens(tokenizer, text, [" three"], max_tokens=len(tokenizer.encode(text)))
    assert seq.finish_reason == "stop" and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == "one two"
