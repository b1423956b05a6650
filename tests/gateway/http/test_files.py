"""/v1/files through the real `openai` SDK against a gateway on a free port: upload, list, retrieve,
content and delete of a batch JSONL file; another key's 404s; refusals naming their field (purpose, not
JSON Lines, too large); and the files surviving a new gateway on the same directory."""

from __future__ import annotations

import json

import openai
import pytest

from gateway.admission.keys import KeyStore
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway

LINES = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
          "body": {"model": "fake-model", "messages": [{"role": "user", "content": f"q{i}"}]}} for i in range(3)]
JSONL = "\n".join(json.dumps(x) for x in LINES).encode() + b"\n"


def _client(base: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


async def test_upload_list_retrieve_content_delete_and_other_keys(tmp_path):
    store = KeyStore(str(tmp_path / "keys.json"))
    alice, bob = store.create("alice", "pro"), store.create("bob", "pro")
    async with fake_gateway(tmp_path, FakeEngine()) as (base, _, _):
        a, b = _client(base, alice), _client(base, bob)
        f = await a.files.create(file=("batch.jsonl", JSONL), purpose="batch")
        assert f.id.startswith("file-") and f.bytes == len(JSONL) and f.filename == "batch.jsonl"
        assert f.purpose == "batch" and f.object == "file"
        g = await a.files.create(file=("second.jsonl", JSONL), purpose="batch")
        assert [x.id for x in (await a.files.list()).data] == [g.id, f.id]  # newest first
        assert [x.id for x in (await a.files.list(limit=1, order="asc")).data] == [f.id]
        assert (await a.files.retrieve(f.id)).bytes == len(JSONL)
        assert (await a.files.content(f.id)).content == JSONL
        for call in (b.files.retrieve(f.id), b.files.content(f.id), b.files.delete(f.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        assert (await b.files.list()).data == []
        assert (await a.files.delete(f.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await a.files.retrieve(f.id)
    async with fake_gateway(tmp_path, FakeEngine()) as (base, _, _):  # a new gateway, the same directory
        assert (await _client(base, alice).files.content(g.id)).content == JSONL


@pytest.mark.parametrize("purpose,data,param,status", [
    ("fine-tune", JSONL, "purpose", 400),
    ("batch", b'{"custom_id": "a"}\nnot json\n', "file", 400),
    ("batch", b"[1, 2]\n", "file", 400),
    ("batch", b"", "file", 400),
    ("batch", b"{}\n" * 40_000, "file", 413),  # over max_mb = 0.1
])
async def test_refused_uploads_name_their_field_and_store_nothing(tmp_path, purpose, data, param, status):
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    async with fake_gateway(tmp_path, FakeEngine(), files={"max_mb": 0.1}) as (base, app, _):
        c = _client(base, key)
        with pytest.raises(openai.APIStatusError) as e:
            await c.files.create(file=("x.jsonl", data), purpose=purpose)  # type: ignore[arg-type]
        assert e.value.status_code == status and e.value.body["param"] == param, e.value.body
        assert (await c.files.list()).data == []
        assert not list((tmp_path / "files").glob("*.partial")) and not list((tmp_path / "files").glob("*.data"))
