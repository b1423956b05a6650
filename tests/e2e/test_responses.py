"""The Responses API with the real model behind a running `sluice serve`: the openai SDK's create, stream,
parse, retrieve, delete and input_items unchanged; a chain whose earlier turns come from the prefix
cache; another key locked out; and the OpenAI Agents SDK running an agent with a function tool to its
final output."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.fixtures.servers import ROOT

pytestmark = [pytest.mark.model, pytest.mark.slow]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: Literal["France", "Italy", "Japan", "Peru", "Kenya"]


def _client(gw, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base + "/v1", api_key=key or gw.key, max_retries=0, timeout=300)


def _other_key(gw) -> str:
    env = {**os.environ, "SLUICE_AUTH__KEYS_FILE": str(gw.keys_file)}
    return subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "create", "--name", "responses-other",
                           "--tier", "pro"], env=env, cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_sdk_create_stream_parse_retrieve_delete(real_gateway):
    c = _client(real_gateway)
    model = c.models.list().data[0].id
    r = c.responses.create(model=model, input="Say hello in one short sentence.", max_output_tokens=40,
                           temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert c.responses.retrieve(r.id).output_text == r.output_text
    assert [i.type for i in c.responses.input_items.list(r.id).data] == ["message"]

    with c.responses.stream(model=model, input="Name three colours, comma separated, nothing else.",
                            max_output_tokens=400, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text and final.status == "completed"
    assert c.responses.retrieve(final.id).output_text == final.output_text

    parsed = c.responses.parse(model=model, input="A city in Japan, as JSON.", text_format=City,
                               max_output_tokens=80, temperature=0)
    assert isinstance(parsed.output_parsed, City)

    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_a_chain_hits_the_prefix_cache_and_another_key_cannot_see_it(real_gateway):
    c = _client(real_gateway)
    model = c.models.list().data[0].id
    system = "You are a terse assistant for a shipping company. " * 40  # ~400 tokens of instructions
    first = c.responses.create(model=model, instructions=system, input="What is a pallet?", max_output_tokens=24,
                               temperature=0)
    second = c.responses.create(model=model, instructions=system, input="And a container?",
                                previous_response_id=first.id, max_output_tokens=24, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    other = _client(real_gateway, _other_key(real_gateway))
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=model, input="continue", previous_response_id=first.id)


def test_an_agent_with_a_function_tool_reaches_a_final_output(real_gateway):
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    client = openai.AsyncOpenAI(base_url=real_gateway.base + "/v1", api_key=real_gateway.key, max_retries=0,
                                timeout=300)
    model = _client(real_gateway).models.list().data[0].id
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather tool's result.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=120),
        tool_use_behavior="stop_on_first_tool")
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls and result.final_output == f"It is sunny and 21 C in {calls[0]}."
