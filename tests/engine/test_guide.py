"""llguidance's tokenizer is built when the first grammar arrives (or at start when asked), and a grammar
that waited for that build gets its whole compile budget after it."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from engine import EngineConfig, RequestRejected, load_frontend
from engine.guide import Guides, GuideStats
from engine.request import Guide

GUIDE = Guide("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"]}))


@pytest.fixture(scope="module")
def tokenizer():
    return load_frontend(EngineConfig()).tokenizer


class CountedJson:
    """The engine tokenizer's JSON, counting the calls and taking `delay` seconds (a slow build)."""

    def __init__(self, tokenizer, delay: float = 0.0):
        self.tokenizer, self.delay, self.calls = tokenizer, delay, 0

    def __call__(self) -> str:
        self.calls += 1
        time.sleep(self.delay)
        return self.tokenizer.to_json()


def guides(tokenizer, source, **kw) -> Guides:
    return Guides(source, tokenizer.vocab_size, tokenizer.eos_token_ids, GuideStats(), **kw)


def wait(ticket, seconds: float = 30.0):
    end = time.monotonic() + seconds
    while not ticket.done:
        assert time.monotonic() < end, "the ticket never finished"
        time.sleep(0.01)
    return ticket.matcher()


def wait_compiled(ticket, seconds: float = 30.0) -> None:
    """Until the compile thread has finished the ticket (its `done` may be true earlier: the budget)."""
    end = time.monotonic() + seconds
    while not ticket._done.is_set():
        assert time.monotonic() < end, "the compile never finished"
        time.sleep(0.01)


def test_the_tokenizer_is_built_for_the_first_grammar_only(tokenizer):
    source = CountedJson(tokenizer)
    g = guides(tokenizer, source)
    try:
        time.sleep(0.3)  # the compile thread is up and idle
        assert source.calls == 0 and g._tokenizer is None and g.clock.ready_at is None
        m = wait(g.submit(GUIDE, []))
        assert source.calls == 1 and g.clock.ready_at is not None
        assert not m.complete and m.error is None
        wait(g.submit(Guide("regex", "[0-9]+"), []))
        assert source.calls == 1  # built once
    finally:
        g.close()


def test_tokenizer_at_start_builds_it_before_any_grammar(tokenizer):
    source = CountedJson(tokenizer)
    g = guides(tokenizer, source, tokenizer_at_start=True)
    try:
        end = time.monotonic() + 30
        while g.clock.ready_at is None:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert source.calls == 1
    finally:
        g.close()


def test_the_compile_budget_starts_when_the_tokenizer_is_ready(tokenizer):
    """A 0.2 s budget and a 0.6 s tokenizer build: the grammar still compiles (its clock starts after the
    build), and a grammar that takes longer than the budget after it is still refused."""
    g = guides(tokenizer, CountedJson(tokenizer, delay=0.6))
    g.limits = dataclasses.replace(g.limits, compile_timeout_s=0.2)
    try:
        ticket = g.submit(GUIDE, [])
        time.sleep(0.4)  # past submission + budget, inside the build
        assert not ticket.done
        assert wait(ticket).error is None
        assert ticket.deadline == pytest.approx(max(ticket.submitted, g.clock.ready_at) + 0.2)
    finally:
        g.close()
    # Once the tokenizer is ready the budget runs from submission, as before.
    g = guides(tokenizer, CountedJson(tokenizer), tokenizer_at_start=True)
    try:
        while g.clock.ready_at is None:
            time.sleep(0.01)
        g.limits = dataclasses.replace(g.limits, compile_timeout_s=1e-6)
        ticket = g.submit(Guide("regex", "[a-z]{3}"), [])
        assert ticket.done  # the budget is spent; the compile (milliseconds) is not
        with pytest.raises(RequestRejected, match="did not compile within"):
            ticket.matcher()
        # a compile that lands after the budget is refused too, however late the engine looks
        late = g.submit(Guide("regex", "[a-z]{4}"), [])
        wait_compiled(late)
        with pytest.raises(RequestRejected, match="did not compile within"):
            late.matcher()
    finally:
        g.close()
