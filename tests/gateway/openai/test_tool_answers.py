"""Tool requests through the `openai` SDK: what the gateway refuses (and how it names the field), and
what a tool call cut by max_tokens looks like in JSON and in a stream. The cut call is checked on a
scripted engine (every cut point, deterministic) and on the real model; grammar errors need the real
engine's grammar compiler."""

from __future__ import annotations

import json

import openai
import pytest

from engine import RequestOutput
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway

MSG = [{"role": "user", "content": "What is the weather like in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"], "additionalProperties": False}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GRAMMAR_WORDS = ("%json", "start:", "<tool_call>", "x-guidance", "calls:", " | ")


class ScriptedEngine(FakeEngine):
    """Writes `script` one character per step (a token each), whatever the prompt: "length" at
    max_tokens, "stop" at the script's end."""

    def __init__(self, script: str):
        super().__init__(max_model_len=4096)
        self.script = script

    def step(self) -> list[RequestOutput]:
        self._touch()
        while self.waiting and len(self.running) < self.config.max_running_requests:
            s = self.waiting.pop(0)
            self.running[s.req.request_id] = s
        outs = []
        for rid, s in list(self.running.items()):
            s.generated.append(ord(self.script[len(s.generated)]))
            cut = len(s.generated) >= s.req.sampling.max_tokens
            done = cut or len(s.generated) == len(self.script)
            outs.append(RequestOutput(request_id=rid, text=chr(s.generated[-1]), token_ids=s.generated[-1:],
                                      finished=done, finish_reason=("length" if cut else "stop") if done else None,
                                      prompt_tokens=len(s.req.prompt_token_ids), completion_tokens=len(s.generated)))
            if done:
                del self.running[rid]
        return outs


def _client(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def _aclient(base: str) -> openai.AsyncOpenAI:
    """For the in-process fake gateway: a blocking client would stall the loop that serves it."""
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


def _fold(chunks) -> tuple[str, list[dict], str | None, list[str]]:
    """(content, calls by index, finish_reason, every content delta) of a streamed answer's chunks."""
    content, deltas, calls, finish = "", [], {}, None
    for chunk in chunks:
        for ch in chunk.choices:
            if ch.delta.content:
                content += ch.delta.content
                deltas.append(ch.delta.content)
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id is not None:
                    c["id"], c["name"] = tc.id, tc.function.name
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, deltas


def _streamed(client: openai.OpenAI, **ask) -> tuple[str, list[dict], str | None, list[str]]:
    return _fold(client.chat.completions.create(stream=True, **ask))


async def _astreamed(client: openai.AsyncOpenAI, **ask) -> tuple[str, list[dict], str | None, list[str]]:
    return _fold([chunk async for chunk in await client.chat.completions.create(stream=True, **ask)])


def _calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


# ---------------------------------------------------------------- a call cut by max_tokens


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
async def test_a_cut_call_is_a_tool_call_so_far_in_json_and_stream(tmp_path, choice):
    async with fake_gateway(tmp_path, ScriptedEngine(CALL)) as (base, app, _):
        c = _aclient(base)
        ask = dict(model="fake-model", messages=MSG, tools=[WEATHER, TIME], tool_choice=choice, temperature=0)
        whole = (await c.chat.completions.create(max_tokens=len(CALL) + 10, **ask)).choices[0]
        assert whole.finish_reason == "tool_calls"
        assert _calls(whole.message) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
        for k in (1, 6, 12, 22, 26, 27, 40, 55, 61, len(CALL) - 5):
            r = (await c.chat.completions.create(max_tokens=k, **ask)).choices[0]
            assert r.finish_reason == "length"
            assert r.message.content is None, (k, r.message.content)
            [call] = r.message.tool_calls or [None]
            assert call is not None and call.id.startswith("call_") and call.type == "function", (k, r.message)
            name, args = call.function.name, call.function.arguments
            assert "get_weather".startswith(name) and '{"city": "Paris"}'.startswith(args), (k, name, args)
            if k >= 27 or isinstance(choice, dict):  # "get_w" written, or the only function allowed
                assert name == "get_weather"
            content, calls, finish, deltas = await _astreamed(c, max_tokens=k, **ask)
            assert not any("<" in d for d in deltas) and content == "", (k, deltas)
            assert finish == "length"
            assert [(x["name"], x["arguments"]) for x in calls] == [(name, args)], k
        assert r.message.tool_calls[0].function.arguments == '{"city": "Paris"}'  # the JSON whole, the tag cut


async def test_free_text_cut_by_max_tokens_stays_text(tmp_path):
    text = "Paris is sunny; I use <tool_call> tags rarely."
    async with fake_gateway(tmp_path, ScriptedEngine(text)) as (base, app, _):
        c = _aclient(base)
        ask = dict(model="fake-model", messages=MSG, tools=[WEATHER], tool_choice="auto", max_tokens=20)
        r = (await c.chat.completions.create(**ask)).choices[0]
        assert (r.message.content, r.message.tool_calls, r.finish_reason) == (text[:20], None, "length")
        content, calls, finish, _ = await _astreamed(c, **ask)
        assert (content, calls, finish) == (text[:20], [], "length")


@pytest.mark.model
def test_the_real_model_cut_by_max_tokens_returns_its_call_so_far(real_gateway):
    c = _client(real_gateway.base, real_gateway.key)
    model = c.models.list().data[0].id
    ask = dict(model=model, messages=MSG, tools=[WEATHER, TIME], temperature=0)
    full = c.chat.completions.create(tool_choice="required", max_tokens=120, **ask).choices[0]
    assert full.finish_reason == "tool_calls"
    whole = _calls(full.message)[0]
    for max_tokens in (3, 24):
        r = c.chat.completions.create(tool_choice="required", max_tokens=max_tokens, **ask).choices[0]
        assert r.finish_reason == "length"
        assert not (r.message.content or "").count("<tool"), r.message.content
        assert r.message.tool_calls, r.message
        got = _calls(r.message)[0]
        assert whole["name"].startswith(got["name"]) and whole["arguments"].startswith(got["arguments"]), got
        content, calls, finish, deltas = _streamed(c, tool_choice="required", max_tokens=max_tokens, **ask)
        assert finish == "length" and not any("<tool" in d for d in deltas) and content == ""
        assert [{"name": x["name"], "arguments": x["arguments"]} for x in calls][:1] == [got]
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(tool_choice=named, max_tokens=3, **ask).choices[0]
    assert r.finish_reason == "length" and r.message.content is None
    assert _calls(r.message)[0]["name"] == "get_time"  # the only function it may call
    many = c.chat.completions.create(tool_choice="required", max_tokens=24, n=4, seed=3,
                                     **{**ask, "temperature": 0.7}).choices
    for ch in many:
        assert not (ch.message.content or "").count("<tool") and ch.message.tool_calls, ch


# ---------------------------------------------------------------- what is refused, by name


@pytest.mark.model
@pytest.mark.parametrize("parameters,why", [
    ({"type": "banana"}, "banana"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_unsupported_tool_parameters_name_the_tool_not_the_grammar(real_gateway, parameters, why, choice):
    c = _client(real_gateway.base, real_gateway.key)
    model = c.models.list().data[0].id
    bad = {"type": "function", "function": {"name": "bad_tool", "parameters": parameters}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=MSG, tools=[WEATHER, bad], tool_choice=choice,
                                      max_tokens=5, stream=stream)
        err = e.value.body
        assert err["param"] == "tools.1.function.parameters", err
        assert why in err["message"] and "bad_tool" in err["message"], err
        assert not any(w in err["message"] for w in GRAMMAR_WORDS), err["message"]


async def test_tool_choice_required_with_response_format_names_response_format(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, engine):
        with pytest.raises(openai.BadRequestError) as e:
            await _aclient(base).chat.completions.create(model="fake-model", messages=MSG, tools=[WEATHER],
                                                  tool_choice="required", response_format={"type": "json_object"})
        assert e.value.body["param"] == "response_format" and e.value.body["code"] == "unsupported_parameter"
        assert not engine.added


async def test_a_tool_message_must_answer_a_call_of_the_assistant_message_before_it(tmp_path):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    second = {**call, "id": "call_2"}
    asked = {"role": "assistant", "content": None, "tool_calls": [call, second]}
    answer = {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"sky": "clear"})}
    refused = [
        ([*MSG, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}], 1, "call_9"),  # no call at all
        ([*MSG, asked, {**answer, "tool_call_id": "call_9"}], 2, "call_9"),  # not one of its calls
        ([*MSG, asked, answer, {**answer, "tool_call_id": "call_7"}], 3, "call_7"),
        ([*MSG, asked, {"role": "user", "content": "and?"}, answer], 3, "call_1"),  # not right after the call
    ]
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=4096)) as (base, app, engine):
        c = _aclient(base)
        for messages, index, bad_id in refused:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="fake-model", messages=messages, tools=[WEATHER], max_tokens=2)
            err = e.value.body
            assert err["param"] == f"messages.{index}.tool_call_id" and bad_id in err["message"], err
        assert not engine.added
        for messages in ([*MSG, asked, answer, {**answer, "tool_call_id": "call_2"}],
                         [*MSG, asked, answer],  # a call left unanswered is not refused
                         [*MSG, asked, answer, {"role": "user", "content": "thanks"}]):
            r = await c.chat.completions.create(model="fake-model", messages=messages, tools=[WEATHER], max_tokens=2)
            assert r.choices[0].finish_reason == "length"
