"""The embedding engine's settings: refused at start when they cannot be honoured, naming the setting;
`max_seq_length` only lowers the model's limit; `auto` picks bf16 matmuls only on CPUs with bf16 units."""

from __future__ import annotations

import pytest
import torch

from engine import EmbeddingConfig, EmbeddingEngine, EmbeddingRequest, EngineConfigError, RequestRejected
from engine.embedding import engine as embedding_engine_module


@pytest.mark.parametrize("changes, words", [
    ({"dtype": "float16"}, "dtype"),
    ({"max_batch_tokens": 0}, "max_batch_tokens"),
    ({"max_seq_length": 1}, "max_seq_length"),
    ({"priority_aging_s": 0.0}, "priority_aging_s"),
])
def test_values_refused_before_loading(changes, words):
    with pytest.raises(EngineConfigError, match=words):
        EmbeddingConfig(**changes).validate_basic()


@pytest.mark.model
@pytest.mark.parametrize("changes, words", [
    ({"max_seq_length": 300}, "exceeds the model's 256"),
    ({"max_batch_tokens": 200}, "cannot hold the longest input"),
])
def test_values_refused_against_the_model(changes, words):
    with pytest.raises(EngineConfigError, match=words):
        EmbeddingEngine(EmbeddingConfig(**changes))


@pytest.mark.model
def test_a_lower_max_seq_length_is_the_engines_limit():
    engine = EmbeddingEngine(EmbeddingConfig(max_seq_length=16, max_batch_tokens=64, served_model_name="mini"))
    assert (engine.model_name, engine.max_input_tokens) == ("mini", 16)
    ids, = engine.tokenize(["one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"])
    with pytest.raises(RequestRejected, match="maximum of 16"):
        engine.add_request(EmbeddingRequest("r", [ids]))
    cut, = engine.tokenize(["one two three four five six seven eight nine ten eleven twelve thirteen fourteen"],
                           truncate=True)
    assert len(cut) == 16 and cut[-1] == 102


def test_auto_dtype_follows_the_cpus_bf16_units(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(embedding_engine_module, "cpu_multiplies_bf16", lambda: True)
    assert embedding_engine_module.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(embedding_engine_module, "cpu_multiplies_bf16", lambda: False)
    assert embedding_engine_module.resolve_dtype("auto", cpu) == torch.float32
    assert embedding_engine_module.resolve_dtype("bfloat16", cpu) == torch.bfloat16
