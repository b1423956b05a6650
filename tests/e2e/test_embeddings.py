"""`/v1/embeddings` through the openai SDK against a running gateway: the real all-MiniLM-L6-v2 beside a
(fake) chat model, checked against sentence-transformers; bad inputs; the wrong kind of model; a query
beside a bulk ingest; chat and embeddings at once; overflow and fallback to a mock provider; usage."""

from __future__ import annotations

import asyncio
import base64
import struct
import time

import numpy as np
import openai
import pytest
from prometheus_client import generate_latest

from engine import EmbeddingConfig, EmbeddingEngine
from gateway.admission.keys import KeyStore
from gateway.admission.ledger import read_sqlite
from gateway.state import STATE
from tests.fixtures.fake_gateway import fake_gateway
from tests.fixtures.mock_provider import MockProvider

pytestmark = pytest.mark.model

EMB = "all-MiniLM-L6-v2"
CHAT = "fake-model"
MODELS = [{"id": CHAT}, {"id": EMB, "kind": "embedding", "aliases": ["text-embedding-3-small"]}]
TEXTS = ["hi", "The quick brown fox jumps over the lazy dog.",
         "Retrieval-augmented generation embeds documents and questions, then generates. " * 6,
         "word " * 400]  # beyond 256 tokens: cut when asked


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine(EmbeddingConfig())


@pytest.fixture(scope="module")
def reference(engine) -> np.ndarray:
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(engine.model_path), device="cpu")
    return model.encode(TEXTS, normalize_embeddings=True)


def sdk(base: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


async def test_vectors_match_sentence_transformers_in_float_and_base64(tmp_path, engine, reference):
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, _app, _):
        c = sdk(base)
        got = await c.embeddings.create(model=EMB, input=TEXTS, encoding_format="float",
                                        extra_body={"truncate": True})
        raw = await c.embeddings.with_raw_response.create(model=EMB, input=TEXTS, extra_body={"truncate": True})
        assert raw.headers["x-sluice-backend"] == "local"
        b64 = raw.parse()  # without an encoding_format the SDK asks for base64 and decodes it into floats
        alias = await c.embeddings.create(model="text-embedding-3-small", input=TEXTS[1], encoding_format="float")
    vectors = np.array([d.embedding for d in got.data])
    assert vectors.shape == (len(TEXTS), 384) and [d.index for d in got.data] == list(range(len(TEXTS)))
    cos = (vectors * reference).sum(axis=1)
    assert cos.min() >= 0.999, cos
    assert got.usage.prompt_tokens == sum(len(ids) for ids in engine.tokenize(TEXTS, truncate=True))
    assert got.usage.total_tokens == got.usage.prompt_tokens and got.model == EMB
    for f, b in zip(got.data, b64.data):  # the same inputs in the same batch: the same float32 values
        assert f.embedding == b.embedding
    assert float(np.dot(alias.data[0].embedding, reference[1])) >= 0.999


async def test_base64_is_little_endian_float32_as_openai_sends_it(tmp_path, engine):
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, _app, _):
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/embeddings", json={"model": EMB, "input": "hello",
                                                             "encoding_format": "base64"}) as r:
                body = await r.json()
            async with s.post(base + "/v1/embeddings", json={"model": EMB, "input": "hello"}) as r:
                floats = (await r.json())["data"][0]["embedding"]
    data = base64.b64decode(body["data"][0]["embedding"])
    assert len(data) == 4 * 384
    assert list(struct.unpack("<384f", data)) == floats


async def test_token_id_inputs_equal_their_text(tmp_path, engine):
    ids = engine.tokenize(["a cat sat on the mat", "trains"])
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, _app, _):
        c = sdk(base)
        text = await c.embeddings.create(model=EMB, input=["a cat sat on the mat", "trains"], encoding_format="float")
        lists = await c.embeddings.create(model=EMB, input=ids, encoding_format="float")
        one = await c.embeddings.create(model=EMB, input=ids[0], encoding_format="float")
    assert lists.usage.prompt_tokens == text.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    for a, b in zip(text.data, lists.data):
        assert np.dot(a.embedding, b.embedding) > 0.9999
    assert np.dot(one.data[0].embedding, text.data[0].embedding) > 0.9999


BAD = [  # (body, param, code)
    ({"input": ""}, "input", None),
    ({"input": []}, "input", None),
    ({"input": ["ok", ""]}, "input", None),
    ({"input": [[]]}, "input", None),
    ({"input": ["x"] * 2049}, "input", None),
    ({"input": [1, "a"]}, "input", None),
    ({"input": [-1]}, "input", None),
    ({"input": [[5, 2**40]]}, "input", None),
    ({"input": [10**8]}, "input", None),  # parses, but is no token of this vocabulary: the engine says so
    ({"input": "word " * 400}, "input", "context_length_exceeded"),
    ({"input": "x", "dimensions": 64}, "dimensions", "unsupported_parameter"),
    ({"input": "x", "dimensions": 0}, "dimensions", None),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "x", "truncate": "yes"}, "truncate", None),
    ({"input": "x", "user": "u" * 300}, "user", None),
    ({"input": "x", "top_k": 3}, "top_k", "unsupported_parameter"),
    ({}, "input", None),
]


async def test_every_bad_input_is_a_400_naming_it(tmp_path, engine):
    import aiohttp

    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, app, _):
        async with aiohttp.ClientSession() as s:
            for body, param, code in BAD:
                async with s.post(base + "/v1/embeddings", json={"model": EMB, **body}) as r:
                    err = (await r.json())["error"]
                    assert r.status == 400, (body, r.status, err)
                    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error", \
                        (body, err)
                    if code is not None:
                        assert err["code"] == code, (body, err)
            async with s.post(base + "/v1/embeddings", data=b"{not json", headers={"Content-Type":
                                                                                   "application/json"}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        assert app[STATE].pool_for(EMB).local_worker.stats().in_flight == 0


async def test_the_wrong_kind_of_model_is_a_400_naming_it(tmp_path, engine):
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, _app, _):
        c = sdk(base)
        with pytest.raises(openai.BadRequestError) as e:
            await c.embeddings.create(model=CHAT, input="x")
        assert e.value.body["param"] == "model" and e.value.body["code"] == "wrong_model_kind"
        assert "/v1/chat/completions" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model=EMB, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["param"] == "model" and "/v1/embeddings" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            await c.completions.create(model="text-embedding-3-small", prompt="hi")
        with pytest.raises(openai.NotFoundError) as e:
            await c.embeddings.create(model="nope", input="x")
        assert EMB in e.value.body["message"]
        listed = [m.id async for m in c.models.list()]
        assert listed == [CHAT, EMB, "text-embedding-3-small"]


async def test_a_pro_query_is_not_stuck_behind_a_standard_ingest(tmp_path, engine):
    """The engine serves a 2,048-input ingest in slices and the pro query takes the next one: the query
    answers in a small part of the ingest's time, while the ingest still runs."""
    store = KeyStore(tmp_path / "keys.json")
    pro, std = store.create("alice", "pro"), store.create("bob", "standard")
    passages = [f"Passage {i}: the committee met on a Tuesday to discuss budgets and the river." for i in range(2048)]
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, _app, _):
        t0 = time.monotonic()
        ingest = asyncio.create_task(sdk(base, std).embeddings.create(model=EMB, input=passages))
        await asyncio.sleep(0.5)
        q0 = time.monotonic()
        await sdk(base, pro).embeddings.create(model=EMB, input="when did the committee meet?")
        query_s = time.monotonic() - q0
        assert not ingest.done()
        result = await ingest
        ingest_s = time.monotonic() - t0
    assert len(result.data) == 2048
    assert query_s < ingest_s / 4, (query_s, ingest_s)


async def test_chat_and_embeddings_at_once(tmp_path, engine):
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, _app, fake):
        c = sdk(base)
        chats = [c.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": f"q{i}"}],
                                           max_tokens=4) for i in range(8)]
        embeds = [c.embeddings.create(model=EMB, input=[f"text {i}", f"more {i}"]) for i in range(8)]
        results = await asyncio.gather(*chats, *embeds)
    assert all(r.choices[0].message.content is not None for r in results[:8])
    assert all(len(r.data) == 2 and len(r.data[0].embedding) == 384 for r in results[8:])


@pytest.fixture
async def mock():
    m = await MockProvider("mock").start()
    yield m
    await m.stop()


def _provider(m: MockProvider, **kw) -> dict:
    return {"name": m.name, "base_url": m.base_url, "input_price_per_m": 0.02, "timeout_s": 2.0,
            "models": {EMB: "text-embedding-3-small", "remote-embed": "text-embedding-3-large"}, **kw}


async def test_remote_only_and_overflow_and_fallback_to_a_provider(tmp_path, engine, mock):
    models = [{"id": CHAT}, {"id": EMB, "kind": "embedding", "max_depth": {"pro": 0, "standard": 0}}]
    async with fake_gateway(tmp_path, models=models, engines={EMB: engine}, providers=[_provider(mock)],
                            routing={"backoff_base_s": 0.01}) as (base, app, _):
        c = sdk(base)
        raw = await c.embeddings.with_raw_response.create(model="remote-embed", input=["a", "b c"],
                                                          encoding_format="float")
        assert raw.headers["x-sluice-backend"] == "remote:mock"
        remote = raw.parse()
        assert len(remote.data) == 2 and remote.model == "remote-embed" and remote.usage.prompt_tokens == 3
        assert mock.requests[-1]["model"] == "text-embedding-3-large" and "truncate" not in mock.requests[-1]
        # the local queue holds nothing (max_depth 0): overflow to the provider serving the model
        raw = await c.embeddings.with_raw_response.create(model=EMB, input="x", extra_body={"truncate": True})
        assert raw.headers["x-sluice-backend"] == "remote:mock"
        assert mock.requests[-1]["model"] == "text-embedding-3-small" and "truncate" not in mock.requests[-1]
        # a provider's 400 is the client's answer
        mock.faults.append(("status", 400))
        with pytest.raises(openai.BadRequestError):
            await c.embeddings.create(model="remote-embed", input="x")
        metrics = app[STATE].metrics
        decisions = {(s.labels["backend"], s.labels["reason"]): s.value
                     for f in metrics.registry.collect() if f.name == "sluice_route_decisions"
                     for s in f.samples if s.name.endswith("_total")}
        assert decisions[("remote", "remote_only")] >= 1 and decisions[("remote", "queue_full")] == 1


async def test_a_failed_local_step_is_retried_remotely(tmp_path, engine, mock, monkeypatch):
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine},
                            providers=[_provider(mock)]) as (base, _app, _):
        def broken(inputs):
            raise RuntimeError("simulated kernel failure")
        monkeypatch.setattr(engine, "embed_ids", broken)
        raw = await sdk(base).embeddings.with_raw_response.create(model=EMB, input="hello")
        assert raw.headers["x-sluice-backend"] == "remote:mock"
        monkeypatch.undo()


async def test_a_failed_local_step_without_a_provider_is_a_500_not_a_hang(tmp_path, engine, monkeypatch):
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, _app, _):
        monkeypatch.setattr(engine, "embed_ids", lambda inputs: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(openai.InternalServerError) as e:
            await asyncio.wait_for(sdk(base).embeddings.create(model=EMB, input="hello"), 30)
        assert e.value.body["code"] == "engine_error"
        monkeypatch.undo()
        ok = await sdk(base).embeddings.create(model=EMB, input="hello")  # the next one is served
        assert len(ok.data) == 1


async def test_usage_is_recorded_per_key_and_model(tmp_path, engine):
    store = KeyStore(tmp_path / "keys.json")
    key = store.create("carol", "standard")
    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine},
                            routing={"local_price": {"input_per_m": 1.0}}) as (base, app, _):
        c = sdk(base, key)
        a = await c.embeddings.create(model=EMB, input=["one two three", "four"])
        b = await c.embeddings.create(model=EMB, input="five six")
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/v1/usage", headers={"Authorization": f"Bearer {key}"}) as r:
                usage = await r.json()
        metrics = generate_latest(app[STATE].metrics.registry).decode()  # (/metrics needs an admin key)
    rows = [r for r in read_sqlite(tmp_path / "usage.sqlite3", 0) if r.model == EMB]  # flushed at close
    assert [(r.key, r.backend, r.completion_tokens) for r in rows] == [("carol", "local", 0)] * 2
    assert sorted(r.prompt_tokens for r in rows) == sorted([a.usage.prompt_tokens, b.usage.prompt_tokens])
    tokens = a.usage.prompt_tokens + b.usage.prompt_tokens
    by_model = usage["by_model"][EMB]
    assert by_model["requests"] == 2 and by_model["prompt_tokens"] == tokens
    assert by_model["cost"] == pytest.approx(tokens / 1e6)
    assert f'sluice_embedding_inputs_total{{backend="local",model="{EMB}"}} 3.0' in metrics
    assert 'sluice_embedding_request_inputs_count{model="all-MiniLM-L6-v2"} 2.0' in metrics


async def test_the_dashboard_shows_each_model(tmp_path, engine):
    import aiohttp

    async with fake_gateway(tmp_path, models=MODELS, engines={EMB: engine}) as (base, _app, _):
        c = sdk(base)
        await c.embeddings.create(model=EMB, input=["one", "two", "three"])
        await c.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/dashboard/data") as r:
                data = await r.json()
    models = {m["id"]: m for m in data["models"]}
    assert models[EMB]["kind"] == "embedding" and models[EMB]["ready"] and models[EMB]["inputs"] == 3
    assert models[EMB]["requests"] == 1 and models[EMB]["prompt_tokens"] > 3
    assert models[CHAT]["kind"] == "chat" and models[CHAT]["requests"] == 1 and models[CHAT]["inputs"] is None
