"""`sluice keys` CLI: a key is printed once, only its hash is stored, list hides it, revoke works."""

from __future__ import annotations

import json
import os
import stat

from gateway.admission.keys import KeyStore, hash_key
from gateway.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_keys_create_list_and_revoke_store_only_the_hash(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)  # no config/sluice.toml here: code defaults
    kf = str(tmp_path / "k" / "keys.json")
    rc, out, err = run(capsys, "keys", "create", "--keys-file", kf, "--name", "alice", "--tier", "pro")
    assert rc == 0
    key = out.strip()
    assert key.startswith("sk-sluice-") and len(key) > 40
    raw = open(kf).read()
    assert key not in raw and hash_key(key) in raw
    assert stat.S_IMODE(os.stat(kf).st_mode) == 0o600
    rec = json.loads(raw)["keys"][0]
    assert rec["name"] == "alice" and rec["tier"] == "pro" and rec["revoked"] is False

    rc, out, _ = run(capsys, "keys", "create", "--keys-file", kf, "--name", "alice", "--tier", "pro")
    assert rc != 0  # duplicate name
    rc, _, err = run(capsys, "keys", "create", "--keys-file", kf, "--name", "x", "--tier", "gold")
    assert rc == 2 and "unknown tier" in err

    rc, out, _ = run(capsys, "keys", "list", "--keys-file", kf)
    assert rc == 0 and "alice" in out and "pro" in out
    assert key not in out and hash_key(key) not in out
    assert KeyStore(kf).lookup(key).name == "alice"

    short = KeyStore(kf).records[0].short_id
    rc, out, _ = run(capsys, "keys", "revoke", "--keys-file", kf, short)
    assert rc == 0 and "alice" in out
    store = KeyStore(kf)
    assert store.lookup(key) is None and store.has_keys()
    rc, out, _ = run(capsys, "keys", "list", "--keys-file", kf)
    assert "yes" in out


def test_admin_keys_are_flagged_and_user_keys_need_a_tier(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    kf = str(tmp_path / "keys.json")
    rc, out, err = run(capsys, "keys", "create", "--keys-file", kf, "--name", "ops", "--admin")
    assert rc == 0 and "admin" in err
    rec = KeyStore(kf).lookup(out.strip())
    assert rec.admin and rec.tier == "standard"  # no --tier: the lowest-priority tier
    rc, out, err = run(capsys, "keys", "create", "--keys-file", kf, "--name", "user")
    assert rc == 2 and "--tier" in err
    rc, out, _ = run(capsys, "keys", "create", "--keys-file", kf, "--name", "user", "--tier", "pro")
    assert rc == 0 and not KeyStore(kf).lookup(out.strip()).admin
    rc, out, _ = run(capsys, "keys", "list", "--keys-file", kf)
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert out.splitlines()[0].split()[-1] == "ADMIN"
    assert rows["ops"][-1] == "yes" and rows["user"][-1] == "no"


def test_keys_commands_refuse_a_corrupt_keys_file(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    kf = tmp_path / "keys.json"
    kf.write_text("{not json")
    for argv in (("create", "--name", "a", "--tier", "pro"), ("list",), ("revoke", "a")):
        rc, _, err = run(capsys, "keys", argv[0], "--keys-file", str(kf), *argv[1:])
        assert rc == 1 and "corrupt" in err, (argv, err)
    assert kf.read_text() == "{not json"  # left for the operator to fix


def test_lookup_rejects_wrong_keys(tmp_path):
    store = KeyStore(tmp_path / "keys.json")
    assert not store.has_keys()
    key = store.create("a", "standard")
    assert store.lookup(key + "x") is None
    assert store.lookup("") is None
    assert store.lookup(key).tier == "standard"


def test_serve_refuses_public_bind_without_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLUICE_AUTH__KEYS_FILE", str(tmp_path / "none.json"))
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, "serve", "--host", "0.0.0.0", "--port", "0")
    assert rc == 2 and "without API keys" in err
