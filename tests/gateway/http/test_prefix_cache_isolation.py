"""Prefix-cache isolation between tenants: the salt the gateway gives each request (gateway/http/prepare.py,
gateway/settings.py cache_salt).

A cache hit shows in `usage.prompt_tokens_details.cached_tokens` (and in TTFT), so a cache shared by
every key lets key B test guesses of key A's prompts. With `auth.prefix_cache_scope = "key"` (the
default) the gateway salts each request's first KV block with its key, so two keys never share blocks;
a client's `cache_salt` narrows the sharing further, never widens it.
"""

from __future__ import annotations

import uuid

import openai
import pytest

from engine import EngineRequest
from gateway.admission.keys import KeyStore
from gateway.openai.schema import ChatCompletionRequest
from gateway.settings import Settings, cache_salt
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway

# ---------------------------------------------------------------- end to end: real model, real gateway


def _long_prompt() -> list[dict[str, str]]:
    # Unique per run (so nothing else in the session has cached it), ~300 tokens.
    system = f"Case file {uuid.uuid4().hex}. " + "The witness describes the river, the bridge and the mill. " * 25
    return [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the case."}]


@pytest.mark.model
def test_two_keys_sending_the_same_long_prompt_see_no_cross_key_cached_tokens(real_gateway):
    gw = real_gateway
    key_b = KeyStore(gw.keys_file).create(f"isolation-{uuid.uuid4().hex[:8]}", "pro")
    a = openai.OpenAI(base_url=gw.base + "/v1", api_key=gw.key, max_retries=0, timeout=120)
    b = openai.OpenAI(base_url=gw.base + "/v1", api_key=key_b, max_retries=0, timeout=120)
    model = a.models.list().data[0].id
    messages = _long_prompt()

    def cached(client: openai.OpenAI, **extra) -> int:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                           extra_body=extra or None)
        assert r.usage.prompt_tokens > 256
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0  # key A's blocks are invisible to key B
    assert cached(b) >= 256  # ...while B's own repeat hits its own blocks
    assert cached(a) >= 256
    # A client salt narrows sharing within the key and cannot reach another key's blocks.
    assert cached(a, cache_salt="conversation-1") == 0
    assert cached(a, cache_salt="conversation-1") >= 256
    assert cached(b, cache_salt="conversation-1") == 0
    assert cached(a, cache_salt="conversation-2") == 0


# ---------------------------------------------------------------- the gateway's salt, per scope (fake engine)


class SaltRecorder(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.salts: list[str | None] = []

    def add_request(self, req: EngineRequest) -> None:
        self.salts.append(req.cache_salt)
        super().add_request(req)


@pytest.mark.parametrize("scope", ["key", "tier", "global"])
async def test_scope_decides_which_requests_share_a_salt(tmp_path, scope):
    keys_file = tmp_path / "keys.json"
    store = KeyStore(keys_file)
    keys = {"a": store.create("a", "pro"), "b": store.create("b", "pro"), "c": store.create("c", "standard")}
    engine = SaltRecorder()
    async with fake_gateway(tmp_path, engine=engine, auth={"keys_file": str(keys_file),
                                                           "prefix_cache_scope": scope}) as (base, app, _):
        async def salt(name: str, client_salt: str | None = None) -> str | None:
            c = openai.AsyncOpenAI(base_url=base + "/v1", api_key=keys[name], max_retries=0, timeout=10)
            await c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=1,
                                            extra_body={"cache_salt": client_salt} if client_salt else None)
            await c.close()
            return engine.salts[-1]

        a, a2, b, c = await salt("a"), await salt("a"), await salt("b"), await salt("c")
        a_s, b_s = await salt("a", "s"), await salt("b", "s")
    assert a == a2
    if scope == "key":
        assert len({a, b, c}) == 3 and None not in {a, b, c}
        assert a_s != b_s  # the client salt never replaces the key part
    elif scope == "tier":
        assert a == b != c and a is not None
        assert a_s == b_s != a
    else:
        assert a is b is c is None  # today's shared cache
        assert a_s == b_s is not None
    assert a_s != a


def test_cache_salt_separates_keys_or_tiers_as_the_scope_says():
    assert cache_salt("key", "alice", "pro", None) != cache_salt("key", "bob", "pro", None)
    assert cache_salt("key", None, "standard", None) is not None  # anonymous: one tenant of its own
    assert cache_salt("key", "x", "x", None) != cache_salt("tier", "y", "x", None)  # scope is part of it
    assert cache_salt("tier", "alice", "pro", None) == cache_salt("tier", "bob", "pro", None)
    assert cache_salt("global", "alice", "pro", None) is None
    assert cache_salt("key", "alice", "pro", "s") != cache_salt("key", "bob", "pro", "s")
    assert Settings().auth.prefix_cache_scope == "key"


def test_client_cache_salt_is_bounded():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**base, "cache_salt": "x" * 256}).cache_salt == "x" * 256
    for bad in ("", "x" * 257, 5):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate({**base, "cache_salt": bad})
