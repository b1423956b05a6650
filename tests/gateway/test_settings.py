"""Settings (gateway/settings.py): the layers (file, environment, arguments), the repository's config file
against the code's defaults, and a provider's prices."""

from __future__ import annotations

import os

import pytest

from gateway.settings import ProviderSettings, Settings
from tests.fixtures.servers import ROOT


def test_settings_layers(tmp_path, monkeypatch):
    from gateway.settings import load_settings

    cfg = tmp_path / "s.toml"
    cfg.write_text('[server]\nport = 7000\nhost = "0.0.0.0"\n[queue]\nmax_batch = 8\n'
                   '[engine]\nmax_running_requests = 3\n')
    monkeypatch.setenv("SLUICE_CONFIG", str(cfg))
    monkeypatch.setenv("SLUICE_SERVER__PORT", "9000")
    s = load_settings(server={"host": "127.0.0.2"})
    assert s.server.port == 9000 and s.server.host == "127.0.0.2" and s.queue.max_batch == 8
    assert s.engine_kwargs()["max_running_requests"] == 3
    assert s.tiers["pro"].priority == 0 and s.tiers["standard"].priority == 1


def test_repo_config_mirrors_defaults(monkeypatch):
    from gateway.settings import Settings, load_settings

    for k in list(os.environ):
        if k.startswith("SLUICE_"):
            monkeypatch.delenv(k)
    assert load_settings(ROOT / "config" / "sluice.toml").model_dump() == Settings().model_dump()



def test_provider_cost_prices_cached_input_apart():
    p = ProviderSettings(name="p", base_url="http://x", input_price_per_m=1.0, output_price_per_m=4.0,
                         cached_input_price_per_m=0.5)
    assert p.cost(1_000_000, 200_000, 500_000) == pytest.approx(0.8 + 0.1 + 2.0)


def test_models_default_to_the_chat_model_and_minilm():
    s = Settings(model={"served_model_name": "smol"})
    entries = s.model_entries()
    assert [(e.id, e.kind) for e in entries] == [("smol", "chat"), ("all-MiniLM-L6-v2", "embedding")]
    assert s.chat_engine_kwargs(entries[0])["served_model_name"] == "smol"


def test_models_need_ids_and_unique_names():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="needs an `id`"):
        Settings(models=[{"kind": "embedding"}])
    with pytest.raises(pydantic.ValidationError, match="names both"):
        Settings(models=[{"id": "a"}, {"id": "b", "kind": "embedding", "aliases": ["a"]}])
    with pytest.raises(pydantic.ValidationError, match="is empty"):
        Settings(models=[])
    with pytest.raises(pydantic.ValidationError):
        Settings(models=[{"id": "a", "kind": "rerank"}])
    s = Settings(engine={"max_running_requests": 3},
                 models=[{}, {"id": "e", "kind": "embedding"}, {"id": "c2", "engine": {"max_running_requests": 5}}])
    first, _, second = s.model_entries()
    assert s.chat_engine_kwargs(first)["max_running_requests"] == 3
    assert s.chat_engine_kwargs(second) == {"max_running_requests": 5, "model": None, "served_model_name": "c2"}


def test_each_model_has_its_own_queue_prefix():
    from gateway.settings import ModelEntry, queue_prefix

    assert queue_prefix("sluice", ModelEntry(), first_chat=True) == "sluice"
    assert queue_prefix("sluice", ModelEntry(id="e", kind="embedding"), first_chat=False) == "sluice:model:e"
