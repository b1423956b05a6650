"""Random-weight GGUFs of the shapes people download, for speed and agreement benches, since nothing can be
downloaded here: Llama 3.2 1B (llama3 RoPE scaling as llama.cpp's `rope_freqs.weight`, tied embeddings,
128k vocabulary, head size 64) and Qwen 2.5 0.5B (QKV bias, 152k vocabulary, head size 64). Written in F16
with gguf-py (weights ~ N(0, 1/fan_in), norms ~ 1), then quantised by llama.cpp's own `llama-quantize`
(bench/setup_llama_server.sh builds it). The tokenizer is SmolLM2's, its vocabulary padded with tokens no
merge makes to the shape's size, so both servers tokenize the bench's prompts the same way.

    python -m bench.random_gguf --shape llama32-1b --type Q4_K_M --out /tmp/llama32-1b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import math
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from engine.loader import default_model_path

ROOT = Path(__file__).resolve().parents[1]
QUANTIZE = ROOT / "bench" / ".llama-server" / "build" / "bin" / "llama-quantize"

SHAPES = {
    # the packaged model's own shape: a stand-in for it where its 98 MB package cannot travel (bench/gpu.sh)
    "smollm2-135m": dict(arch="llama", layers=30, hidden=576, inter=1536, heads=9, kv_heads=3, vocab=49152,
                         rope_base=100000.0, eps=1e-5, bias=False, llama3=None),
    "llama32-1b": dict(arch="llama", layers=16, hidden=2048, inter=8192, heads=32, kv_heads=8, vocab=128256,
                       rope_base=500000.0, eps=1e-5, bias=False,
                       llama3=dict(factor=32.0, low=1.0, high=4.0, original=8192)),
    "qwen25-05b": dict(arch="qwen2", layers=24, hidden=896, inter=4864, heads=14, kv_heads=2, vocab=151936,
                       rope_base=1000000.0, eps=1e-6, bias=True, llama3=None),
}


def llama3_factors(head_dim: int, base: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py rule for `rope_freqs.weight`."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tokenizer(path: Path) -> None:
    """A GGUF of the packaged model's tokenizer fields alone (no tensors, 2 MB): what `--tokenizer-from`
    reads where the model's package is not installed."""
    import gguf

    src = gguf.GGUFReader(str(default_model_path()))
    w = gguf.GGUFWriter(str(path), "llama")
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_f16(path: Path, shape: str, seed: int = 0, tokenizer_from: Path | None = None, bf16: bool = False) -> None:
    """The shape with random weights in F16 (`bf16`: BF16, as gguf-py rounds them)."""
    import gguf

    s = SHAPES[shape]
    arch, hidden, heads, kv, vocab = s["arch"], s["hidden"], s["heads"], s["kv_heads"], s["vocab"]
    d = hidden // heads
    src = gguf.GGUFReader(str(tokenizer_from or default_model_path()))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random {shape}")
    w.add_block_count(s["layers"])
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.MOSTLY_F16)
    # SmolLM2's tokenizer, padded to the vocabulary with plain tokens no merge makes (as control tokens, 79k
    # of them made llguidance's tokenizer take 30 s to build; a real Llama 3 has 256)
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())
    types = list(src.fields["tokenizer.ggml.token_type"].contents())
    pad = vocab - len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(src.fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(tokens + [f"unused{i}" for i in range(pad)])
    w.add_token_types(types + [int(gguf.TokenType.NORMAL)] * pad)
    w.add_token_merges(list(src.fields["tokenizer.ggml.merges"].contents()))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(src.fields["tokenizer.chat_template"].contents())
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    def add_mat(name: str, rows: int, cols: int) -> None:
        m = mat(rows, cols)
        if bf16:
            w.add_tensor(name, gguf.quants.quantize(m.astype(np.float32), gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, m)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    add_mat("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", norm(hidden))
    if s["llama3"] is not None:
        c = s["llama3"]
        w.add_tensor("rope_freqs.weight", llama3_factors(d, s["rope_base"], c["factor"], c["low"], c["high"],
                                                         c["original"]))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(hidden))
        w.add_tensor(p + "ffn_norm.weight", norm(hidden))
        for name, rows in (("attn_q", heads * d), ("attn_k", kv * d), ("attn_v", kv * d)):
            add_mat(p + name + ".weight", rows, hidden)
            if s["bias"]:
                w.add_tensor(p + name + ".bias", (0.1 * rng.standard_normal(rows, dtype=np.float32)))
        add_mat(p + "attn_output.weight", hidden, heads * d)
        add_mat(p + "ffn_gate.weight", s["inter"], hidden)
        add_mat(p + "ffn_up.weight", s["inter"], hidden)
        add_mat(p + "ffn_down.weight", hidden, s["inter"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama32-1b")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name, or F16 (BF16) to "
                    "write the weights in it with gguf-py alone")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", default=None, help="a GGUF with the tokenizer fields (default: the packaged "
                    "model's)")
    ap.add_argument("--tokenizer-only", action="store_true", help="write only the packaged model's tokenizer fields")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.tokenizer_only:
        write_tokenizer(out)
        return
    if a.type in ("F16", "BF16"):
        write_f16(out, a.shape, tokenizer_from=Path(a.tokenizer_from) if a.tokenizer_from else None,
                  bf16=a.type == "BF16")
        return
    if not QUANTIZE.exists():
        raise SystemExit(f"{QUANTIZE} is missing: bash bench/setup_llama_server.sh")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "f16.gguf"
        write_f16(src, a.shape)
        subprocess.run([str(QUANTIZE), str(src), str(out), a.type], check=True, capture_output=True)
    print(f"{out}: {out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
