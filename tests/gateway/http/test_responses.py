"""/v1/responses through the real `openai` SDK against a gateway on a free port, with the fake engine (it
answers with its prompt's text, so what a turn was given is visible in its answer): the store and its
per-key isolation, chains, streamed events against the spec's event schemas, background runs and
cancel, a failure mid-stream, and refusals naming their field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import jsonschema
import openai
import pytest

from gateway.admission.keys import KeyStore
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway

SPEC = json.loads((Path(__file__).resolve().parents[3].parent / "shared" / "openai-api" /
                   "openapi-subset.json").read_text())


# each stream event's schema, by its `type` (validating against the union hides which branch failed)
EVENT_SCHEMAS = {SPEC["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["enum"][0]:
                 ref["$ref"].rsplit("/", 1)[1] for ref in SPEC["components"]["schemas"]["ResponseStreamEvent"]["anyOf"]}


def _conforms(obj: dict, schema: str) -> None:
    jsonschema.validate(obj, {"$ref": f"#/components/schemas/{schema}", "components": SPEC["components"]})


async def _raw(base: str, key: str, method: str, path: str, body: dict | None = None) -> list[dict]:
    """The JSON the gateway sent (a body, or each SSE event's data), not the SDK's model of it."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        async with s.request(method, base + "/v1" + path, json=body) as r:
            if r.content_type != "text/event-stream":
                return [await r.json()]
            text = await r.text()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def _keys(tmp_path: Path) -> tuple[str, str]:
    store = KeyStore(str(tmp_path / "keys.json"))
    return store.create("alice", "pro"), store.create("bob", "pro")


def _client(base: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


async def test_create_retrieve_list_delete_and_store_false(tmp_path):
    alice, _ = _keys(tmp_path)
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=512)) as (base, _, _):
        c = _client(base, alice)
        r = await c.responses.create(model="fake-model", input="hello there", max_output_tokens=64,
                                     instructions="be brief", metadata={"team": "a"})
        # the fake always runs to max_output_tokens: an incomplete response (the real model's complete: tests/e2e)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.object == "response" and r.id.startswith("resp_")
        assert "hello there" in r.output_text and "be brief" in r.output_text  # the fake echoes its prompt
        assert r.usage.input_tokens > 0 and r.usage.output_tokens == len(r.output_text)
        assert r.metadata == {"team": "a"} and r.instructions == "be brief"
        _conforms((await _raw(base, alice, "GET", f"/responses/{r.id}"))[0], "Response")
        got = await c.responses.retrieve(r.id)
        assert got.output_text == r.output_text and got.status == "incomplete"
        items = await c.responses.input_items.list(r.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "hello there")]
        assert (await c.responses.delete(r.id)) is None
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(r.id)
        unstored = await c.responses.create(model="fake-model", input="x", store=False, max_output_tokens=4)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(unstored.id)


async def test_a_chain_carries_every_turn_and_only_its_key_sees_it(tmp_path):
    alice, bob = _keys(tmp_path)
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=2048)) as (base, _, _):
        a, b = _client(base, alice), _client(base, bob)
        first = await a.responses.create(model="fake-model", input="first question", max_output_tokens=40)
        second = await a.responses.create(model="fake-model", input="second question",
                                          previous_response_id=first.id, max_output_tokens=400)
        # turn 2's prompt held turn 1's input and answer, then its own input
        text = second.output_text
        assert text.startswith(f"user: first question\nassistant: {first.output_text}\nuser: second question\n")
        assert second.previous_response_id == first.id
        for call in (b.responses.retrieve(first.id), b.responses.delete(first.id),
                     b.responses.input_items.list(first.id), b.responses.cancel(first.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        with pytest.raises(openai.NotFoundError) as e:
            await b.responses.create(model="fake-model", input="steal", previous_response_id=first.id)
        assert e.value.body["param"] == "previous_response_id"
        assert (await a.responses.retrieve(first.id)).id == first.id  # still there for its owner


async def test_streamed_events_conform_and_end_with_one_terminal_event(tmp_path):
    alice, _ = _keys(tmp_path)
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=512)) as (base, _, _):
        c = _client(base, alice)
        for max_out, terminal in ((300, "response.incomplete"), (7, "response.incomplete")):
            events = [e async for e in await c.responses.create(model="fake-model", input="stream me",
                                                                 max_output_tokens=max_out, stream=True)]
            kinds = [e.type for e in events]
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert kinds[-1] == terminal and sum(k in ("response.completed", "response.incomplete",
                                                       "response.failed") for k in kinds) == 1
            assert [e.sequence_number for e in events] == list(range(len(events)))
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            final = events[-1].response
            assert text == final.output_text and text
            assert (await c.responses.retrieve(final.id)).output_text == text
            assert final.incomplete_details.reason == "max_output_tokens" and len(text) == max_out
        raw = await _raw(base, alice, "POST", "/responses", {"model": "fake-model", "input": "raw", "stream": True,
                                                           "max_output_tokens": 12})
        for e in raw:
            _conforms(e, EVENT_SCHEMAS[e["type"]])
        assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
        # the SDK's helper reads them (its get_final_response() needs response.completed: tests/e2e)
        async with c.responses.stream(model="fake-model", input="helper", max_output_tokens=40) as s:
            seen = [e async for e in s]
        assert seen[-1].type == "response.incomplete" and "helper" in seen[-1].response.output_text


async def test_a_failure_mid_stream_ends_with_response_failed(tmp_path):
    alice, _ = _keys(tmp_path)
    engine = FakeEngine(max_model_len=512, step_s=0.01)
    async with fake_gateway(tmp_path, engine) as (base, _, _):
        c = _client(base, alice)
        stream = await c.responses.create(model="fake-model", input="x" * 100, max_output_tokens=200, stream=True)
        events = []
        async for e in stream:
            events.append(e)
            if e.type == "response.output_text.delta" and len(events) == 6:
                engine.fail_next_step = True
        assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
        assert sum(e.type.startswith("response.") and e.type in ("response.completed", "response.failed",
                                                                  "response.incomplete") for e in events) == 1
        assert (await c.responses.retrieve(events[-1].response.id)).status == "failed"


async def test_background_runs_polls_and_cancels(tmp_path):
    alice, _ = _keys(tmp_path)
    engine = FakeEngine(max_model_len=512)
    async with fake_gateway(tmp_path, engine) as (base, _, _):
        c = _client(base, alice)
        r = await c.responses.create(model="fake-model", input="in the background", background=True,
                                     max_output_tokens=50)
        assert r.status == "queued" and r.background
        for _ in range(200):
            r = await c.responses.retrieve(r.id)
            if r.status not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.02)
        assert r.status == "incomplete" and "in the background" in r.output_text
        engine.gate.clear()  # hold the engine: the next one stays in progress
        try:
            held = await c.responses.create(model="fake-model", input="never", background=True, max_output_tokens=50)
            await asyncio.sleep(0.2)
            cancelled = await c.responses.cancel(held.id)
            assert cancelled.status == "cancelled"
            assert (await c.responses.retrieve(held.id)).status == "cancelled"
        finally:
            engine.gate.set()
        plain = await c.responses.create(model="fake-model", input="now", max_output_tokens=5)
        with pytest.raises(openai.BadRequestError):  # only background responses are cancelled
            await c.responses.cancel(plain.id)


async def test_function_calls_and_their_outputs_round_trip_as_items(tmp_path):
    alice, _ = _keys(tmp_path)
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=4096)) as (base, _, _):
        c = _client(base, alice)
        tool = {"type": "function", "name": "get_weather", "description": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
        r = await c.responses.create(model="fake-model", max_output_tokens=1500, tools=[tool], input=[
            {"role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"}])
        # the prompt (echoed) rendered the call and its output, and the tool's definition
        assert "get_weather" in r.output_text and "sunny, 21C" in r.output_text and "Paris" in r.output_text
        items = (await c.responses.input_items.list(r.id, order="asc")).data
        assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input[0].content[0]"),
    ({"input": ""}, "input"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema"}}, "background": True}, "text.format"),  # not queued first
    ({"background": True, "store": False}, "background"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
async def test_refusals_name_their_field(tmp_path, body, param):
    alice, _ = _keys(tmp_path)
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=512)) as (base, _, _):
        c = _client(base, alice)
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
            await c.responses.create(model="fake-model", **{"input": "hi", **body})
        assert e.value.body["param"] == param, e.value.body
        assert e.value.body["message"]


async def test_truncation_disabled_refuses_and_auto_drops_the_oldest_turns(tmp_path):
    alice, _ = _keys(tmp_path)
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=300)) as (base, _, _):
        c = _client(base, alice)
        prev = None
        for i in range(4):  # four turns of ~70 characters each: the chain outgrows 300 tokens
            r = await c.responses.create(model="fake-model", input=f"turn {i} " + "w" * 60, max_output_tokens=8,
                                         previous_response_id=prev, truncation="auto")
            prev = r.id
        with pytest.raises(openai.BadRequestError) as e:
            await c.responses.create(model="fake-model", input="last", previous_response_id=prev,
                                     max_output_tokens=8)
        assert e.value.body["code"] == "context_length_exceeded"
        r = await c.responses.create(model="fake-model", input="last", previous_response_id=prev,
                                     max_output_tokens=200, truncation="auto")
        assert r.status in ("completed", "incomplete") and "turn 0" not in r.output_text


async def test_a_chain_moves_to_a_provider_and_back_keeping_the_conversation(tmp_path, providers):
    """Turn 2's local step fails, so the router sends it to the provider (bridged to chat); the store is
    Sluice's, so turn 2 carries turn 1 to the provider and turn 3, local again, carries both."""
    from tests.fixtures.providers import LOCAL_MODEL, gateway, provider_cfg
    a, _ = providers
    engine = FakeEngine(max_model_len=4096)
    async with gateway(tmp_path, [provider_cfg(a)], engine=engine, keys={"alice": "pro"}) as (base, _, _, keys):
        c = _client(base, keys["alice"])
        raw = await c.responses.with_raw_response.create(model=LOCAL_MODEL, input="turn one", max_output_tokens=30)
        first = raw.parse()
        assert raw.headers["x-sluice-backend"] == "local"
        engine.fail_next_step = True
        raw = await c.responses.with_raw_response.create(model=LOCAL_MODEL, input="turn two", max_output_tokens=4,
                                                         previous_response_id=first.id)
        second = raw.parse()
        assert raw.headers["x-sluice-backend"] == "remote:a" and second.output_text == "w0 w1 w2 w3"
        sent = a.requests[-1]["messages"]
        assert [m["content"] for m in sent] == ["turn one", first.output_text, "turn two"]
        third = await c.responses.create(model=LOCAL_MODEL, input="turn three", previous_response_id=second.id,
                                         max_output_tokens=400)
        assert "turn one" in third.output_text and "w0 w1 w2 w3" in third.output_text
        assert "turn three" in third.output_text


async def test_metrics_label_responses_by_route_not_by_id(tmp_path):
    alice, _ = _keys(tmp_path)
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=512)) as (base, _, _):
        c = _client(base, alice)
        ids = [(await c.responses.create(model="fake-model", input=f"n{i}", max_output_tokens=3)).id for i in range(3)]
        for rid in ids + ["resp_missing"]:
            try:
                await c.responses.retrieve(rid)
            except openai.NotFoundError:
                pass
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {alice}"}) as s:
            await s.get(base + "/v1/no/such/path")
        admin = KeyStore(str(tmp_path / "keys.json")).create("ops", "pro", admin=True)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin}"}) as s:
            text = await (await s.get(base + "/metrics")).text()
        lines = [ln for ln in text.splitlines() if ln.startswith("sluice_requests_total{")]
        assert not any("resp_" in ln for ln in lines), lines
        assert any('endpoint="/v1/responses/{response_id}"' in ln and 'status="200"' in ln and ln.endswith(" 3.0")
                   for ln in lines), lines
        assert any('endpoint="unmatched"' in ln for ln in lines), lines


async def test_gateways_sharing_redis_continue_each_others_chains(tmp_path, redis_server):
    alice, bob = _keys(tmp_path)
    prefix = {"queue": {"key_prefix": f"resp{id(tmp_path)}"}}
    async with fake_gateway(tmp_path / "a", FakeEngine(max_model_len=2048), redis_url=redis_server.url,
                            auth={"keys_file": str(tmp_path / "keys.json")}, **prefix) as (base_a, _, _), \
            fake_gateway(tmp_path / "b", FakeEngine(max_model_len=2048), redis_url=redis_server.url,
                         auth={"keys_file": str(tmp_path / "keys.json")}, **prefix) as (base_b, _, _):
        first = await _client(base_a, alice).responses.create(model="fake-model", input="on a", max_output_tokens=20)
        second = await _client(base_b, alice).responses.create(model="fake-model", input="on b", max_output_tokens=200,
                                                               previous_response_id=first.id)
        assert second.output_text.startswith(f"user: on a\nassistant: {first.output_text}\nuser: on b\n")
        assert (await _client(base_b, alice).responses.retrieve(first.id)).id == first.id
        with pytest.raises(openai.NotFoundError):
            await _client(base_b, bob).responses.retrieve(first.id)


async def test_a_provider_that_serves_responses_gets_them_natively_with_the_chain(tmp_path, providers):
    """A remote-only model on a provider marked `responses`: POST /v1/responses reaches its /v1/responses
    with the whole chain as `input` and `store: false`; the store, the ids and the usage are Sluice's."""
    from tests.fixtures.providers import REMOTE_MODEL, gateway, provider_cfg
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a, responses=True)], keys={"alice": "pro", "bob": "pro"}) as (
            base, app, _, keys):
        c = _client(base, keys["alice"])
        raw = await c.responses.with_raw_response.create(model=REMOTE_MODEL, input="one two", instructions="hi",
                                                         max_output_tokens=3)
        first = raw.parse()
        assert raw.headers["x-sluice-backend"] == "remote:a" and first.output_text == "w0 w1 w2"
        assert a.requests[-1]["_path"] == "/v1/responses" and a.requests[-1]["store"] is False
        assert first.id.startswith("resp_") and "mock" not in first.id and first.usage.input_tokens == 2
        events = [e async for e in await c.responses.create(model=REMOTE_MODEL, input="three", stream=True,
                                                             previous_response_id=first.id)]
        sent = a.requests[-1]
        assert [i.get("role") for i in sent["input"]] == ["user", "assistant", "user"]
        assert sent["input"][1]["content"][0]["text"] == "w0 w1 w2" and "previous_response_id" not in sent
        assert events[-1].type == "response.completed" and [e.sequence_number for e in events] == list(
            range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text == (await c.responses.retrieve(events[-1].response.id)
                                                            ).output_text
        with pytest.raises(openai.NotFoundError):
            await _client(base, keys["bob"]).responses.retrieve(first.id)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {keys['alice']}"}) as s:
            usage = await (await s.get(base + "/v1/usage")).json()
        # both answers accounted at the provider's prices: its usage (2 + 6 input words, 3 + 8 words out)
        assert usage["by_backend"]["remote:a"]["requests"] == 2
        assert usage["totals"]["prompt_tokens"] == 8 and usage["totals"]["completion_tokens"] == 11
        assert usage["totals"]["cost"] == pytest.approx((8 * 1.0 + 11 * 2.0) / 1e6)
