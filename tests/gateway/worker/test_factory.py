"""gateway/worker/factory.py: the engines' configuration from the settings, before any weight loads."""

import pytest

from engine import EngineConfigError
from gateway.settings import ModelEntry, load_settings
from gateway.worker.factory import _embedding_config, _engine_config


def test_engine_options_from_the_settings_and_the_environment_reach_the_config(monkeypatch):
    monkeypatch.setenv("SLUICE_ENGINE__WIDE_MIN_ROWS", "0")
    cfg = _engine_config(load_settings(None, engine={"kv_cache_tokens": 4096}))
    assert (cfg.wide_min_rows, cfg.kv_cache_tokens) == (0, 4096)


@pytest.mark.parametrize("source", ["section", "environment"])
def test_an_unknown_engine_option_is_refused_by_name_not_dropped(monkeypatch, source):
    """A renamed or misspelled option (wide_rows, say, for wide_min_rows) must not leave the engine on its
    default without a word."""
    if source == "environment":
        monkeypatch.setenv("SLUICE_ENGINE__WIDE_ROWS", "0")
        settings = load_settings(None)
    else:
        settings = load_settings(None, engine={"wide_rows": 0, "kv_cache_tokens": 4096})
    with pytest.raises(EngineConfigError, match="wide_rows"):
        _engine_config(settings)


def test_an_unknown_embedding_option_is_refused_by_name():
    entry = ModelEntry(kind="embedding", path="/models/x", engine={"max_batch_token": 512})
    with pytest.raises(EngineConfigError, match="max_batch_token"):
        _embedding_config(entry)
    entry = ModelEntry(kind="embedding", path="/models/x", engine={"max_batch_tokens": 512})
    assert _embedding_config(entry).max_batch_tokens == 512
