"""The embedding engine's settings: refused at start when they cannot be honoured, naming the setting;
`max_seq_length` only lowers the model's limit."""

from __future__ import annotations

import pytest

from engine import EmbeddingConfig, EmbeddingEngine, EmbeddingRequest, EngineConfigError, RequestRejected


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
