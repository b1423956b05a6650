"""Batches with the real models behind a running `sluice serve`: a chat batch and an embeddings batch from
upload to output file through the openai SDK, each line's answer equal to the same request sent alone
(greedy chat; embeddings within float tolerance)."""

from __future__ import annotations

import json
import time

import openai
import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _run(c: openai.OpenAI, endpoint: str, lines: list[dict]) -> list[dict]:
    data = "\n".join(json.dumps(x) for x in lines).encode()
    f = c.files.create(file=("in.jsonl", data), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    deadline = time.time() + 240
    while b.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.time() < deadline, b
        time.sleep(0.2)
        b = c.batches.retrieve(b.id)
    assert b.status == "completed" and b.request_counts.completed == len(lines) and not b.error_file_id, b
    return [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]


def test_chat_and_embedding_batches_answer_as_the_lines_would_alone(real_gateway):
    c = openai.OpenAI(base_url=real_gateway.base + "/v1", api_key=real_gateway.key, max_retries=0, timeout=300)
    chat_model = c.models.list().data[0].id
    bodies = [{"model": chat_model, "messages": [{"role": "user", "content": f"Name a colour, number {i}."}],
               "max_tokens": 12, "temperature": 0} for i in range(8)]
    out = _run(c, "/v1/chat/completions", [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                            "body": b} for i, b in enumerate(bodies)])
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(8)]
    for o, body in zip(out, bodies):
        alone = c.chat.completions.create(**body)
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
    texts = ["a cat on a mat", "trains leave at noon", "the pallet ships on Tuesday"]
    out = _run(c, "/v1/embeddings", [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                      "body": {"model": "all-MiniLM-L6-v2", "input": t}} for i, t in enumerate(texts)])
    for o, t in zip(out, texts):
        got = o["response"]["body"]["data"][0]["embedding"]
        want = c.embeddings.create(model="all-MiniLM-L6-v2", input=t).data[0].embedding
        assert len(got) == 384 and sum(a * b for a, b in zip(got, want)) > 0.999
