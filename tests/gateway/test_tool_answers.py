"""Tool requests through the `openai` SDK: what the gateway refuses, and how it names the field.
Grammar errors need the real engine's grammar compiler."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.conftest import fake_gateway
from tests.gateway.fake_engine import FakeEngine

MSG = [{"role": "user", "content": "What is the weather like in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"], "additionalProperties": False}}}
GRAMMAR_WORDS = ("%json", "start:", "<tool_call>", "x-guidance", "calls:", " | ")


def _client(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def _aclient(base: str) -> openai.AsyncOpenAI:
    """For the in-process fake gateway: a blocking client would stall the loop that serves it."""
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


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
