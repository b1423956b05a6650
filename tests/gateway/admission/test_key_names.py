"""Key names cannot alias anonymous use: `keys create` refuses empty, blank and reserved names (through the
CLI and the store), a keys file holding a blank name is refused, and the usage and budget code keeps
anonymous use (key None) apart from every named key, also across a restart through the ledger."""

from __future__ import annotations

import json

import pytest

from gateway.admission.keys import KeyStore, KeyStoreError
from gateway.admission.ledger import SQLiteLedger, UsageRow
from gateway.admission.usage import UsageStore
from gateway.cli import main as cli_main


@pytest.mark.parametrize("name", ["", "   ", "anonymous", "Anonymous", " anonymous "])
def test_cli_refuses_empty_blank_and_reserved_names(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setenv("SLUICE_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text("")
    keys_file = tmp_path / "keys.json"
    assert cli_main(["keys", "create", "--keys-file", str(keys_file), "--name", name, "--tier", "pro"]) != 0
    out = capsys.readouterr()
    assert out.out == ""  # no key printed
    assert "sluice:" in out.err and ("reserved" in out.err or "empty or blank" in out.err), out.err
    assert not keys_file.exists() or KeyStore(keys_file).records == []
    assert cli_main(["keys", "create", "--keys-file", str(keys_file), "--name", "anon-team", "--tier", "pro"]) == 0


def test_store_refuses_them_and_a_file_with_a_blank_name(tmp_path):
    store = KeyStore(tmp_path / "keys.json")
    for name in ("", "\t", "anonymous"):
        with pytest.raises(KeyStoreError):
            store.create(name, "pro")
    store.create("team-a", "pro")
    data = json.loads((tmp_path / "keys.json").read_text())
    data["keys"].append({**data["keys"][0], "name": " ", "key_hash": "0" * 64})
    (tmp_path / "keys.json").write_text(json.dumps(data))
    with pytest.raises(KeyStoreError, match="empty or blank name"):
        KeyStore(tmp_path / "keys.json", strict=True)


async def test_anonymous_use_and_a_key_named_anonymous_are_two_buckets(tmp_path):
    store = UsageStore()
    await store.record(None, "m", "local", 10, 0, 5, 0.25)
    await store.record(None, "m", "local", 10, 0, 5, 0.25)
    await store.record("anonymous", "m", "local", 1, 0, 1, 0.01)  # a key of that name from an old keys file
    await store.record("", "m", "local", 1, 0, 1, 0.02)
    assert (await store.totals(None))["totals"]["requests"] == 2
    assert (await store.totals("anonymous"))["totals"]["requests"] == 1
    assert await store.spent("anonymous") == pytest.approx(0.01)
    assert await store.spent("") == pytest.approx(0.02)
    # a budget of the named key is not spent by anonymous use
    assert (await store.reserve("anonymous", 0.1, "r1", 0.05)).ok
    assert not (await store.reserve(None, 0.5, "r2", 0.05)).ok

    ledger = SQLiteLedger(tmp_path / "usage.sqlite3")
    ledger.append(UsageRow(1.0, None, "standard", "m", "local", 10, 0, 5, 0.25, 0.25))
    ledger.append(UsageRow(2.0, "anonymous", "pro", "m", "local", 1, 0, 1, 0.01, 0.01))
    await ledger.close()
    again = SQLiteLedger(tmp_path / "usage.sqlite3")
    fresh = UsageStore()
    fresh.restore(await again.totals_by_key() or {})
    await again.close()
    assert await fresh.spent(None) == pytest.approx(0.25)
    assert await fresh.spent("anonymous") == pytest.approx(0.01)
