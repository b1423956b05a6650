"""The Hermes tool-call format: rendering, the grammar, parsing, and streamed deltas that reassemble to
exactly the non-streamed answer. No model: the grammar is checked with llguidance and the real tokenizer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.guide import Guides, GuideStats
from gateway.openai import tools
from gateway.openai.tools import CallDelta, ContentDelta, ToolCallStreamer, ToolSpec

WEATHER = ToolSpec("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False})
TIME = ToolSpec("get_time", "Time in a zone", {"type": "object", "properties": {"zone": {"type": "string"}},
                                                "required": ["zone"]})


@pytest.fixture(scope="module")
def guides():
    from engine import EngineConfig, load_frontend

    tok = load_frontend(EngineConfig()).tokenizer
    return Guides(tok.to_json, tok.vocab_size, tok.eos_token_ids, GuideStats()), tok


def _accepts(guides_tok, guide, text: str) -> bool:
    guides, tok = guides_tok
    m = guides.matcher(guide, [])
    for t in tok.encode(text):
        if m.matcher.is_stopped():
            return False
        m.advance(t)
        if m.error is not None:
            return False
    return m.matcher.is_accepting()


def test_required_grammar_accepts_valid_calls_only(guides):
    g = tools.tool_guide([WEATHER, TIME], required=True, parallel=True)
    ok = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    assert _accepts(guides, g, ok)
    second = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert _accepts(guides, g, ok + "\n" + second)
    assert not _accepts(guides, g, "Sure, it is sunny.")
    assert not _accepts(guides, g, '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>')
    assert not _accepts(guides, g, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    single = tools.tool_guide([WEATHER], required=True, parallel=False)
    assert not _accepts(guides, single, ok + "\n" + ok)


def test_auto_grammar_allows_text_or_valid_calls(guides):
    g = tools.tool_guide([WEATHER], required=False, parallel=True)
    assert _accepts(guides, g, "It is sunny in Paris today.")
    assert _accepts(guides, g, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert not _accepts(guides, g, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Rome"}}\n</tool_call>')


def test_parse_calls_and_content():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = tools.parse_tool_calls(text)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id.startswith("call_")
    assert tools.parse_tool_calls("no calls here") == ("no calls here", [])
    assert tools.parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def _reassemble(events):
    content, calls = "", {}
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
        else:
            c = calls.setdefault(e.index, {"id": None, "name": None, "arguments": ""})
            if e.id is not None:  # a call's first delta: its id and name (a cut call's may be "")
                c["id"], c["name"] = e.id, e.name
            c["arguments"] += e.arguments
    return content, [calls[i] for i in sorted(calls)]


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
       prefix=st.sampled_from(["", "Let me check. "]))
def test_streamed_deltas_reassemble_to_the_parsed_answer(cuts, prefix):
    text = prefix + ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"Z\\""}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    ids = ["call_a", "call_b"]
    content, calls = tools.parse_tool_calls(text, ids)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    s = ToolCallStreamer(ids)
    events = [e for p in pieces for e in s.feed(p)] + s.finish()
    got_content, got_calls = _reassemble(events)
    assert (got_content or None) == content
    assert got_calls == [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
    firsts = [e for e in events if isinstance(e, CallDelta) and e.id is not None]
    assert [e.name for e in firsts] == ["get_weather", "get_time"]  # id and name come first, once


def test_plain_text_streams_through_with_partial_tags_held_back():
    s = ToolCallStreamer()
    out = s.feed("Hello <tool") + s.feed("s are fun") + s.finish()
    assert "".join(e.text for e in out if isinstance(e, ContentDelta)) == "Hello <tools are fun"


def test_rendering_the_conversation():
    msgs = tools.with_tool_system([{"role": "user", "content": "weather?"}], [WEATHER])
    assert msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"] and "get_weather" in msgs[0]["content"]
    call = tools.render_call("get_weather", '{"city": "Paris"}')
    assert call.startswith("<tool_call>") and json.loads(call.split("\n")[1]) == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert tools.render_tool_result("21C") == "<tool_response>\n21C\n</tool_response>"


CUT_TEXTS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"Z\\"", "unit": "c"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
]
NAMES = ["get_weather", "get_time"]


@pytest.mark.parametrize("text", CUT_TEXTS)
def test_a_call_cut_by_max_tokens_is_a_call_so_far_never_markup(text):
    """At every cut point of calls the grammar allows (required, named or auto), the answer is the calls
    so far: a cut name completed only where one function fits, the arguments' JSON text so far."""
    ids = ["call_a", "call_b"]
    _, full = tools.parse_tool_calls(text, ids)
    for k in range(1, len(text) + 1):
        content, calls = tools.parse_tool_calls(text[:k], ids, cut=True, names=NAMES)
        assert content is None, (text[:k], content)
        assert 1 <= len(calls) <= len(full), text[:k]
        for got, want in zip(calls, full):
            assert got.id == want.id
            assert want.name.startswith(got.name) and want.arguments.startswith(got.arguments), (text[:k], got)
            if got.name not in NAMES:  # a cut name: completed when only one function begins with it
                assert sum(n.startswith(got.name) for n in NAMES) != 1, (text[:k], got)
        if text[:k].endswith("get_w"):
            assert calls[-1].name == "get_weather"


@settings(max_examples=60, deadline=None)
@given(end=st.integers(min_value=0, max_value=300), cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=8),
       prefix=st.sampled_from(["", "Let me check. "]), which=st.sampled_from(CUT_TEXTS))
def test_a_streamed_cut_call_reassembles_to_the_cut_json_answer(end, cuts, prefix, which):
    text = (prefix + which)[:end]
    ids = ["call_a", "call_b"]
    content, calls = tools.parse_tool_calls(text, ids, cut=True, names=NAMES)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    s = ToolCallStreamer(ids, NAMES)
    events = [e for p in pieces for e in s.feed(p)] + s.finish(cut=True)
    got_content, got_calls = _reassemble(events)
    assert (got_content or None) == (content or None)
    assert got_calls == [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
    if "<tool_call>" in text or not prefix:
        assert "<tool" not in (got_content or ""), text


def test_a_named_function_cut_in_its_tag_is_that_function():
    content, calls = tools.parse_tool_calls("<tool_", ["call_a"], cut=True, names=["get_time"])
    assert content is None and [(c.id, c.name, c.arguments) for c in calls] == [("call_a", "get_time", "")]
    assert tools.parse_tool_calls("<tool_", ["call_a"]) == ("<tool_", [])  # not cut: plain text
    # free text that mentions the tag stays text, cut or not
    assert tools.parse_tool_calls("I use <tool_", cut=True, names=NAMES) == ("I use <tool_", [])
    assert tools.parse_tool_calls("<tool_call> is a tag", cut=True, names=NAMES) == ("<tool_call> is a tag", [])


def test_the_engines_grammar_error_reads_without_the_grammar():
    engine = ('the grammar is not supported: at 3(7): failed to compile JSON schema: Invalid type: banana\n'
              '   1 | start: calls\n   2 | calls: call\n   3 | call: "<tool_call>\\n" %json {"type": "banana"}\n'
              '             ^\n')
    assert tools._engine_reason(engine) == "Invalid type: banana"
    assert tools._engine_reason("the grammar is not supported: at 1(2): something else\n   1 | start: x") == \
        "something else"
    budget = "the grammar is not supported: the spec is larger than the compile budget of 100 bytes"
    assert tools._engine_reason(budget) == "the spec is larger than the compile budget of 100 bytes"


async def test_a_refused_tool_grammar_names_the_function_whose_schema_fails():
    bad = ToolSpec("bad_tool", "", {"type": "object", "properties": {"a": {"type": "banana"}}})
    engine = "the grammar is not supported: at 3(7): failed to compile JSON schema: Invalid type: banana\n   1 | x"
    param, message = await tools.invalid_tool([WEATHER, bad], engine)
    assert param == "tools.1.function.parameters" and "bad_tool" in message and "Invalid type: banana" in message
    # a refusal that is no compile error (the compile budget, a grammar with no first token): no compile here
    before = tools._schema_problem.cache_info()
    param, message = await tools.invalid_tool([WEATHER, bad], "the grammar is not supported: no token can start "
                                                               "the output")
    assert (param, message) == ("tools", "tools: the functions' JSON schemas cannot be used: no token can start "
                                         "the output")
    assert tools._schema_problem.cache_info() == before
