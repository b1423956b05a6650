"""What the request schema (gateway/openai/schema.py) accepts and refuses, through a gateway on the fake
engine: seed and n bounds, deep JSON, OpenAI fields Sluice does not implement (refused by name, harmless
values let through), and logit_bias keys that must be canonical token ids."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from tests.fixtures.fake_gateway import fake_gateway

MSG = [{"role": "user", "content": "hi"}]


def _client(base: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


# ---------------------------------------------------------------- bounds


async def test_seed_nesting_and_n_bounds(tmp_path):
    async with fake_gateway(tmp_path, queue={"max_depth": {"pro": 8, "standard": 2}}) as (base, app, _):
        c = _client(base)
        for seed, n in ((2**70, 1), (2**64 - 1, 2), (2**63, 1), (-(2**63) - 1, 1)):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="fake-model", messages=MSG, seed=seed, n=n, max_tokens=2)
            assert e.value.body["param"] == "seed"
        r = await c.chat.completions.create(model="fake-model", messages=MSG, seed=2**63 - 1, n=2, max_tokens=2)
        assert len(r.choices) == 2
        with pytest.raises(openai.BadRequestError) as e:  # more choices than the tier can ever queue
            await c.chat.completions.create(model="fake-model", messages=MSG, n=3, max_tokens=2)
        assert e.value.body["param"] == "n"
        async with aiohttp.ClientSession() as s:
            deep = b'{"model": "fake-model", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
            async with s.post(base + "/v1/chat/completions", data=deep) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "invalid_json"


# ---------------------------------------------------------------- nothing accepted is ignored


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("prediction", {"type": "content", "content": "x"}),
    ("logit_bias", {"not-a-token": 5}),
    ("top_logprobs", 3),  # without logprobs: true
    ("tool_choice", "required"),  # without tools
    ("audio", {"voice": "alloy", "format": "mp3"}),
    ("store", True),
    ("service_tier", "flex"),
    ("not_an_openai_field", 1),
])
async def test_unimplemented_fields_are_refused_by_name(tmp_path, field, value):
    async with fake_gateway(tmp_path) as (base, app, engine):
        with pytest.raises(openai.BadRequestError) as e:
            await _client(base).chat.completions.create(model="fake-model", messages=MSG, max_tokens=2,
                                                        extra_body={field: value})
        assert e.value.body["param"] == field and field in e.value.body["message"]
        assert not engine.added


async def test_harmless_values_of_unimplemented_fields_pass(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, _):
        r = await _client(base).chat.completions.create(
            model="fake-model", messages=MSG, max_tokens=2, presence_penalty=0, frequency_penalty=0,
            response_format={"type": "text"}, store=False, service_tier="auto", tool_choice="none", user="u-1")
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as e:
            await _client(base).completions.create(model="fake-model", prompt="x", echo=True)
        assert "echo" in e.value.body["message"]


@pytest.mark.parametrize("bias,bad", [
    ({"٢٨": 5}, "٢٨"), ({"２８": 5}, "２８"), ({"0028": 5}, "0028"), ({"²": 5}, "²"), ({"+28": 5}, "+28"),
    ({" 28": 5}, " 28"), ({"28\n": 5}, "28\n"), ({"28": 100, "028": -100}, "028"), ({"2147483648": 1}, "2147483648"),
])
async def test_logit_bias_keys_are_canonical_ascii_token_ids(tmp_path, bias, bad):
    async with fake_gateway(tmp_path) as (base, app, engine):
        for create in (lambda c: c.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2,
                                                           logit_bias=bias),
                       lambda c: c.completions.create(model="fake-model", prompt="x", max_tokens=2, logit_bias=bias)):
            with pytest.raises(openai.BadRequestError) as e:
                await create(_client(base))
            err = e.value.body
            assert err["param"] == "logit_bias" and repr(bad) in err["message"], err
            assert "invalid literal" not in err["message"]
        assert not engine.added


def test_canonical_logit_bias_keys_map_to_their_ids():
    from gateway.http.offload import RequestLimits, parse_request
    from gateway.openai.schema import CompletionRequest

    body = {"model": "m", "prompt": "x", "logit_bias": {"0": -1, "28": 5, "2147483647": 1}}
    req = parse_request(json.dumps(body).encode(), CompletionRequest, RequestLimits())
    assert req.logit_bias_ids() == {0: -1.0, 28: 5.0, 2147483647: 1.0}


def test_engine_only_fields_are_those_set_to_a_value_that_changes_the_answer():
    from gateway.openai.schema import ChatCompletionRequest, CompletionRequest, engine_only_fields

    msgs = [{"role": "user", "content": "hi"}]
    assert engine_only_fields(ChatCompletionRequest(model="m", messages=msgs)) == []
    assert engine_only_fields(ChatCompletionRequest(model="m", messages=msgs, top_k=-1, ignore_eos=False,
                                                    repetition_penalty=1.0, min_tokens=0)) == []
    got = engine_only_fields(ChatCompletionRequest(model="m", messages=msgs, top_k=3, stop_token_ids=[2],
                                                   prompt_truncation="middle", repetition_penalty=1.1))
    assert got == ["top_k", "stop_token_ids", "prompt_truncation", "repetition_penalty"]
    guided = CompletionRequest(model="m", prompt="x", guided_json={"type": "object"})
    assert engine_only_fields(guided) == ["guided_json"]
    assert engine_only_fields(None) == []
