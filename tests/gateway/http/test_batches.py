"""/v1/batches through the real `openai` SDK against a gateway on a free port (fake engine: it answers
with its prompt's text): a chat batch from upload to output file, error lines, validation failures,
cancel, another key's 404s, and a restart that finishes the lines without results exactly once."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from gateway.admission.keys import KeyStore
from gateway.http.batches import BATCHES
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway


def _line(i: int, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": url,
            "body": {"model": "fake-model", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4,
                     **body}}


def _jsonl(lines: list) -> bytes:
    return "\n".join(json.dumps(x) for x in lines).encode() + b"\n"


def _client(base: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


async def _until_done(c: openai.AsyncOpenAI, batch_id: str, timeout: float = 20.0):
    for _ in range(int(timeout / 0.05)):
        b = await c.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch still {b.status}")


async def test_a_chat_batch_runs_to_its_output_and_error_files(tmp_path):
    store = KeyStore(str(tmp_path / "keys.json"))
    alice, bob = store.create("alice", "pro"), store.create("bob", "pro")
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=256)) as (base, _, _):
        c = _client(base, alice)
        lines = [_line(i) for i in range(6)] + [_line(6, max_tokens=999_999)]  # the fake refuses that one
        f = await c.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                   metadata={"job": "nightly"})
        assert b.status == "validating" and b.metadata == {"job": "nightly"}
        done = await _until_done(c, b.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 6, 1)
        out = [json.loads(x) for x in (await c.files.content(done.output_file_id)).text.splitlines()]
        assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(6)]
        for i, o in enumerate(out):
            assert o["response"]["status_code"] == 200
            assert o["response"]["body"]["choices"][0]["message"]["content"] == f"user: q{i}\nassistant: "[:4]
        err = [json.loads(x) for x in (await c.files.content(done.error_file_id)).text.splitlines()]
        assert [(e["custom_id"], e["response"]["status_code"]) for e in err] == [("r6", 400)]
        assert [x.id for x in (await c.batches.list()).data] == [b.id]
        other = _client(base, bob)
        for call in (other.batches.retrieve(b.id), other.batches.cancel(b.id),
                     other.files.content(done.output_file_id)):
            with pytest.raises(openai.NotFoundError):
                await call
        assert (await other.batches.list()).data == []


@pytest.mark.parametrize("lines,code", [
    ([_line(0), _line(0)], "duplicate_custom_id"),
    ([_line(0, url="/v1/completions")], "mismatched_endpoint"),
    ([{**_line(0), "body": {**_line(0)["body"], "model": "nope"}}], "model_not_found"),
    ([{**_line(0), "method": "GET"}], "invalid_method"),
    ([_line(0, stream=True)], "invalid_value"),
])
async def test_invalid_input_files_fail_the_batch_naming_the_line(tmp_path, lines, code):
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    async with fake_gateway(tmp_path, FakeEngine()) as (base, _, _):
        c = _client(base, key)
        f = await c.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        b = await _until_done(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                         completion_window="24h")).id)
        assert b.status == "failed" and b.errors.data[0].code == code and b.errors.data[0].line == len(lines)


async def test_create_refuses_what_it_cannot_run(tmp_path):
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    async with fake_gateway(tmp_path, FakeEngine()) as (base, _, _):
        c = _client(base, key)
        with pytest.raises(openai.NotFoundError) as e:
            await c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
        assert e.value.body["param"] == "input_file_id"
        f = await c.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch")
        for kw, param in (({"endpoint": "/v1/moderations"}, "endpoint"), ({"completion_window": "1h"},
                                                                          "completion_window")):
            with pytest.raises(openai.BadRequestError) as e:
                await c.batches.create(**{"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h", **kw})
            assert e.value.body["param"] == param


async def test_cancel_stops_admitting_lines_and_keeps_what_finished(tmp_path):
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    engine = FakeEngine(max_model_len=256, step_s=0.01)
    async with fake_gateway(tmp_path, engine, batches={"max_in_flight": 1}) as (base, _, _):
        c = _client(base, key)
        f = await c.files.create(file=("in.jsonl", _jsonl([_line(i, max_tokens=30) for i in range(40)])),
                                 purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        for _ in range(400):
            got = await c.batches.retrieve(b.id)
            if got.request_counts.completed >= 2:
                break
            await asyncio.sleep(0.02)
        assert (await c.batches.cancel(b.id)).status == "cancelling"
        done = await _until_done(c, b.id)
        assert done.status == "cancelled" and 2 <= done.request_counts.completed < 40
        out = (await c.files.content(done.output_file_id)).text.splitlines()
        assert len(out) == done.request_counts.completed


async def test_a_restart_finishes_every_line_exactly_once(tmp_path):
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    engine = FakeEngine(max_model_len=256, step_s=0.01)
    async with fake_gateway(tmp_path, engine, batches={"max_in_flight": 2}) as (base, app, _):
        c = _client(base, key)
        f = await c.files.create(file=("in.jsonl", _jsonl([_line(i, max_tokens=20) for i in range(20)])),
                                 purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        for _ in range(400):
            if len(await app[BATCHES].results(b.id)) >= 3:
                break
            await asyncio.sleep(0.02)
    # the gateway stopped mid-batch (its runner cancelled): a new one on the same directory resumes it
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=256)) as (base, _, _):
        c = _client(base, key)
        done = await _until_done(c, b.id)
        assert done.status == "completed" and done.request_counts.completed == 20
        out = [json.loads(x)["custom_id"] for x in (await c.files.content(done.output_file_id)).text.splitlines()]
        assert out == [f"r{i}" for i in range(20)]  # each line once, in input order


async def test_an_interactive_request_takes_engine_room_back_from_the_batch(tmp_path):
    """Batch lines fill the engine; an interactive request arrives: the newest lines beyond
    beside_interactive are cancelled and queued again, and the batch still answers every line once."""
    from gateway.http.batches import RUNNER
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    engine = FakeEngine(max_running_requests=4, max_model_len=256, step_s=0.01)
    async with fake_gateway(tmp_path, engine, batches={"max_in_flight": 4, "beside_interactive": 1,
                                                       "interactive_window_s": 0.2}) as (base, app, _):
        c = _client(base, key)
        f = await c.files.create(file=("in.jsonl", _jsonl([_line(i, max_tokens=40) for i in range(12)])),
                                 purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        runner = app[RUNNER]
        for _ in range(400):
            if len(runner.calling.get("fake-model", [])) == 4:
                break
            await asyncio.sleep(0.01)
        assert len(runner.calling["fake-model"]) == 4  # the batch fills the engine
        answer = await c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "now"}],
                                                 max_tokens=5)
        assert answer.choices[0].message.content == "user:"
        assert runner.lines_taken_back == 3  # down to beside_interactive = 1
        done = await _until_done(c, b.id)
        assert done.status == "completed" and done.request_counts.completed == 12
        out = [json.loads(x)["custom_id"] for x in (await c.files.content(done.output_file_id)).text.splitlines()]
        assert out == [f"r{i}" for i in range(12)]


async def test_sluice_batch_submits_watches_and_downloads(tmp_path):
    """The `sluice batch` command line against a running gateway: exit 0, the output file beside the input."""
    import sys

    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl([_line(i) for i in range(5)] + [_line(5, max_tokens=999_999)]))
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=256)) as (base, _, _):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "batch", str(src), "--base-url", base + "/v1", "--api-key", key,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 1, err.decode()[-500:]  # one line failed: not a clean run
    assert out.decode().splitlines()[0].startswith("batch_")
    lines = [json.loads(x) for x in (tmp_path / "in.jsonl.out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"r{i}" for i in range(5)]
    errors = [json.loads(x) for x in (tmp_path / "in.jsonl.err.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in errors] == ["r5"]


async def test_gateways_sharing_the_directory_run_each_batch_once(tmp_path):
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    shared = {"files": {"dir": str(tmp_path / "shared")}, "auth": {"keys_file": str(tmp_path / "keys.json")}}
    one, two = FakeEngine(max_model_len=256, step_s=0.005), FakeEngine(max_model_len=256, step_s=0.005)
    async with fake_gateway(tmp_path / "a", one, **shared) as (base_a, _, _), \
            fake_gateway(tmp_path / "b", two, **shared) as (base_b, _, _):
        a = _client(base_a, key)
        f = await a.files.create(file=("in.jsonl", _jsonl([_line(i, max_tokens=8) for i in range(10)])),
                                 purpose="batch")
        b = await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = await _until_done(_client(base_b, key), b.id)  # visible on both
        assert done.status == "completed" and done.request_counts.completed == 10
        assert len(one.added) + len(two.added) == 10 and (not one.added or not two.added)  # one runner did it all


def _ledger(tmp_path) -> list:
    from gateway.admission.ledger import read_sqlite
    return list(read_sqlite(tmp_path / "usage.sqlite3", 0.0))


async def test_batch_lines_are_flagged_and_priced_at_the_batch_price(tmp_path):
    """Usage rows of batch lines carry `batch` and cost [batches] price_factor of the same online request."""
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    price = {"input_per_m": 1e6, "output_per_m": 2e6}  # a token: $1 in, $2 out
    async with fake_gateway(tmp_path, FakeEngine(max_model_len=256), routing={"local_price": price},
                            batches={"price_factor": 0.25}) as (base, _, _):
        c = _client(base, key)
        f = await c.files.create(file=("in.jsonl", _jsonl([_line(i) for i in range(3)])), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert (await _until_done(c, b.id)).request_counts.completed == 3
        online = await c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "q0"}],
                                                 max_tokens=4)
    rows = _ledger(tmp_path)
    assert sorted(r.batch for r in rows) == [False, True, True, True]
    full = online.usage.prompt_tokens + 2 * online.usage.completion_tokens
    assert [r.cost for r in rows if not r.batch] == [pytest.approx(full)]
    assert all(r.cost == pytest.approx((r.prompt_tokens + 2 * r.completion_tokens) * 0.25) for r in rows if r.batch)


async def test_lines_taken_back_are_charged_once(tmp_path):
    """A line cancelled for interactive traffic is answered again later: one usage row per line."""
    from gateway.http.batches import RUNNER
    key = KeyStore(str(tmp_path / "keys.json")).create("alice", "pro")
    engine = FakeEngine(max_running_requests=4, max_model_len=256, step_s=0.01)
    async with fake_gateway(tmp_path, engine, batches={"max_in_flight": 4, "beside_interactive": 1,
                                                       "interactive_window_s": 0.2}) as (base, app, _):
        c = _client(base, key)
        f = await c.files.create(file=("in.jsonl", _jsonl([_line(i, max_tokens=40) for i in range(8)])),
                                 purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        runner = app[RUNNER]
        for _ in range(400):
            if len(runner.calling.get("fake-model", [])) == 4 and len(engine.added) >= 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the lines have tokens out
        await c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "now"}],
                                        max_tokens=5)
        assert runner.lines_taken_back == 3
        assert (await _until_done(c, b.id)).request_counts.completed == 8
    rows = _ledger(tmp_path)
    assert sum(r.batch for r in rows) == 8 and sum(not r.batch for r in rows) == 1


async def test_a_keys_batch_quota_holds_its_lines_not_anothers(tmp_path):
    """`batch_lines`: at most that many of the key's lines at once; `batch_tokens_per_day`: once used up the
    key's batch waits (cancel still ends it), while another key's batch runs."""
    from gateway.http.batches import RUNNER
    store = KeyStore(str(tmp_path / "keys.json"))
    alice, bob, carol = store.create("alice", "pro"), store.create("bob", "pro"), store.create("carol", "pro")
    limits = {"keys": {"alice": {"batch_lines": 1}, "carol": {"batch_lines": 1, "batch_tokens_per_day": 1}}}
    engine = FakeEngine(max_model_len=256, step_s=0.01)
    async with fake_gateway(tmp_path, engine, limits=limits, batches={"max_in_flight": 8}) as (base, app, _):
        runner = app[RUNNER]
        ids = {}
        for name, key in (("alice", alice), ("bob", bob), ("carol", carol)):
            c = _client(base, key)
            f = await c.files.create(file=("in.jsonl", _jsonl([_line(i, max_tokens=10) for i in range(6)])),
                                     purpose="batch")
            ids[name] = (c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
        most: dict[str, int] = {}
        for _ in range(1000):
            for name, n in runner.by_owner.items():
                most[name] = max(most.get(name, 0), n)
            done = [await c.batches.retrieve(bid) for c, bid in (ids["alice"], ids["bob"])]
            if all(d.status == "completed" for d in done):
                break
            await asyncio.sleep(0.01)
        assert [d.request_counts.completed for d in done] == [6, 6]
        assert most["alice"] == 1 and most["bob"] > 1
        c, bid = ids["carol"]
        held = await c.batches.retrieve(bid)
        assert held.status == "in_progress" and held.request_counts.completed == 1  # its day's tokens: used
        assert (await c.batches.cancel(bid)).status == "cancelling"
        assert (await _until_done(c, bid)).status == "cancelled"
