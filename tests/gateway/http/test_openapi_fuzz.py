"""OpenAI's own spec (../shared/openai-api/openapi-subset.json) drives generated requests at a running
gateway: no 5xx, and every documented response conforms to the schema.

The gateway runs on the fake engine (instant generation, so the example budget goes to shapes, not to
waiting for tokens) in a thread of its own; the generated `model` is pointed at the served model for
most examples so that requests get past the model lookup and exercise validation, queueing and the
response encoders.
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import zlib
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
import json  # noqa: E402

import jsonschema  # noqa: E402
import requests  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

from gateway.admission.keys import KeyStore  # noqa: E402
from gateway.http.app import create_app  # noqa: E402
from gateway.settings import Settings  # noqa: E402
from gateway.state import STATE  # noqa: E402
from tests.fixtures.fake_engine import FakeEngine  # noqa: E402

SPEC = Path(__file__).resolve().parents[3].parent / "shared" / "openai-api" / "openapi-subset.json"
if not SPEC.is_file():  # CI clones the project with shared/ beside it; a bare checkout may not have it
    pytest.skip(f"OpenAI spec not found at {SPEC}", allow_module_level=True)

EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "120"))
_SPEC = json.loads(SPEC.read_text())
schema = schemathesis.openapi.from_path(str(SPEC))
# Every operation of the spec subset is served, and held to the spec's response schemas (with the few
# places where OpenAI's API and the spec differ checked as the API answers, below).
SERVED = (r"^/(chat/completions|completions|embeddings|models(/\{model\})?"
          r"|responses(/\{response_id\}(/cancel|/input_items)?)?|files(/\{file_id\}(/content)?)?"
          r"|batches(/\{batch_id\}(/cancel)?)?)$")
EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # the real one (small): /embeddings reaches its engine
# POST /responses is left out of the generated cases: schemathesis cannot generate bodies for the spec's
# CreateResponse ("a `not` whose complement is not spelled out"); test_responses_fuzz below drives it.
served = schema.include(path_regex=SERVED).exclude(method="POST", path="/responses")
# The spec documents a bare error object as the 404 of these; OpenAI's API (and so the SDK) answers
# with the `{"error": {...}}` envelope, as Sluice does: checked as such below.
BARE_404 = {("DELETE", "/responses/{response_id}"), ("POST", "/responses/{response_id}/cancel")}


class _ServerThread:
    """The gateway app on a real port, on its own event loop (schemathesis calls it synchronously)."""

    def __init__(self, tmp: Path):
        from aiohttp import web

        self.tmp = tmp
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self._web = web
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        settings_ = Settings(auth={"keys_file": str(self.tmp / "keys.json")},
                             models=[{"id": "fake-model"}, {"id": EMBEDDING_MODEL, "kind": "embedding"}])
        app = create_app(settings_, engine=FakeEngine(max_running_requests=8, max_model_len=4096),
                         keys=KeyStore(settings_.auth.keys_file))
        self.runner = self._web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = self._web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        async def until_ready() -> None:
            while not app[STATE].ready:
                await asyncio.sleep(0.01)
        self.loop.run_until_complete(until_ready())
        self.ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        async def cleanup() -> None:
            await self.runner.cleanup()
        asyncio.run_coroutine_threadsafe(cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory):
    server = _ServerThread(tmp_path_factory.mktemp("fuzz"))
    server.thread.start()
    assert server.ready.wait(30)
    yield f"http://127.0.0.1:{server.port}/v1"
    server.stop()


@served.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_openai_spec(case, gateway_url):
    if isinstance(case.body, dict) and "model" in case.body and zlib.crc32(repr(case.body).encode()) % 4:
        # three in four reach the engine
        case.body["model"] = EMBEDDING_MODEL if case.path == "/embeddings" else "fake-model"
    if case.path == "/embeddings" and isinstance(case.body, dict) and case.body.get("encoding_format") == "base64":
        # The spec types `embedding` as numbers only; OpenAI's API answers base64 with a string, as Sluice
        # does (tests/e2e/test_embeddings.py holds it equal to the float answer).
        response = case.call(base_url=gateway_url, timeout=30)
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code == 200:
            assert all(isinstance(d["embedding"], str) and base64.b64decode(d["embedding"], validate=True)
                       for d in response.json()["data"])
        return
    if (case.method.upper(), case.path) in (("GET", "/files"), ("GET", "/batches")):
        # An empty list's first_id/last_id are null, as OpenAI's API sends them (the spec types them as strings).
        response = case.call(base_url=gateway_url, timeout=30)
        if response.status_code == 200 and not response.json()["data"]:
            assert response.json()["first_id"] is None and response.json()["last_id"] is None
            return
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        return
    if (case.method.upper(), case.path) in BARE_404:
        response = case.call(base_url=gateway_url, timeout=30)
        if response.status_code == 404:
            assert response.json()["error"]["code"] == "not_found"
            return
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        return
    case.call_and_validate(base_url=gateway_url, checks=[not_a_server_error, response_schema_conformance],
                           timeout=30)


@pytest.mark.parametrize("method,path", [("POST", "/moderations"), ("GET", "/fine_tuning/jobs"),
                                         ("POST", "/images/generations"), ("DELETE", "/models/x/y")])
def test_operations_sluice_does_not_serve_are_openai_404s(method, path, gateway_url):
    """Every operation of the spec subset is served now; the rest of OpenAI's API gets its 404."""
    response = requests.request(method, gateway_url + path, json={}, timeout=30)
    assert response.status_code == 404, (method, path, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "not_found" and error["message"]


_ITEM = st.one_of(
    st.text(max_size=40),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "x"]),
                           "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal",
                                                         "input_file", "bogus"]),
                                "text": st.text(max_size=10)}), max_size=3), st.integers(), st.none())}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning",
                                                    "message", "web_search_call", "item_reference"]),
                           "call_id": st.one_of(st.text(max_size=8), st.none()),
                           "name": st.one_of(st.text(max_size=8), st.integers()),
                           "arguments": st.one_of(st.text(max_size=8), st.none()),
                           "output": st.one_of(st.text(max_size=8), st.lists(st.dictionaries(
                               st.sampled_from(["type", "text"]), st.text(max_size=4)), max_size=2))}),
)
_BODY = st.fixed_dictionaries({"model": st.sampled_from(["fake-model", "nope", EMBEDDING_MODEL])}, optional={
    "input": st.one_of(st.text(max_size=60), st.lists(_ITEM, max_size=4), st.integers()),
    "instructions": st.one_of(st.text(max_size=30), st.none(), st.integers()),
    "max_output_tokens": st.one_of(st.integers(-2, 40), st.none()),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), st.none()),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), st.none()),
    "store": st.one_of(st.booleans(), st.none()),
    "stream": st.one_of(st.booleans(), st.none()),
    "background": st.booleans(),
    "truncation": st.sampled_from(["auto", "disabled", "sometimes"]),
    "previous_response_id": st.one_of(st.just("resp_missing"), st.none()),
    "tools": st.lists(st.one_of(
        st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g", "bad name"]),
                               "parameters": st.one_of(st.just({"type": "object"}), st.none(), st.just(
                                   {"type": "object", "properties": {"a": {"$ref": "#/x"}}}))}),
        st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "function"])})),
        max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "sometimes"]),
                             st.fixed_dictionaries({"type": st.just("function"), "name": st.just("f")})),
    "text": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
        optional={"name": st.just("x"), "schema": st.just({"type": "object"})})}), st.just({"verbosity": "low"})),
    "metadata": st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3), st.integers()),
    "include": st.lists(st.sampled_from(["reasoning.encrypted_content"]), max_size=1),
    "reasoning": st.one_of(st.just({"effort": None}), st.just({"effort": "high"})),
    "parallel_tool_calls": st.booleans(),
    "user": st.text(max_size=8),
    "unknown_field": st.integers(),
})


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=_BODY)
def test_responses_fuzz(body, gateway_url):
    """Generated POST /responses bodies, valid and not: never a 5xx; a 200 is a Response (or its events)
    that conforms to the spec, anything else OpenAI's error envelope naming what is wrong."""
    r = requests.post(gateway_url + "/responses", json=body, timeout=30)
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and error["type"], body
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert sum(e["type"] in ("response.completed", "response.incomplete", "response.failed")
                   for e in events) == 1 and events[-1]["type"].startswith("response.")
        response = events[-1]["response"]
    else:
        response = r.json()
    jsonschema.validate(response, {"$ref": "#/components/schemas/Response", "components": _SPEC["components"]})
