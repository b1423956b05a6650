"""Engine decode throughput at batch 1, 32 and 128 against the HBM bandwidth bound.

    python -m bench.gpu_engine            # CUDA: default model (SmolLM2-135M) and a random-weight Llama-1B shape
    python -m bench.gpu_engine --dry-run  # CPU: the default model and a tiny random Llama, tiny runs,
                                          # plus one tiny run with SLUICE_KERNELS=triton (interpreted)

Decode tokens/s counts only steps in which every scheduled sequence decodes (prefill steps excluded).
Bound: each decode step reads every weight once plus each sequence's KV context, so
tokens/s <= batch * HBM / (weight bytes + batch * mean context * KV bytes per token).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

HBM_BYTES_PER_S = 4.8e12


def random_llama(shape: str, device: str, dtype: torch.dtype):
    """A LoadedModel with the default model's tokenizer and random weights of a Llama shape."""
    from engine.loader import ModelArgs, load_model

    base = load_model(None)
    vocab = base.args.vocab_size  # keep the tokenizer's ids valid
    if shape == "1b":  # Llama-3.2-1B body (vocab kept at the tokenizer's)
        args = ModelArgs(vocab_size=vocab, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                         head_dim=64, intermediate_size=8192, rope_theta=500000.0, max_position_embeddings=4096)
    else:
        args = ModelArgs(vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, max_position_embeddings=1024)
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*s):
        return (torch.randn(*s, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    h, i, dq, dkv = args.hidden_size, args.intermediate_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    w = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": torch.ones(h, device=device, dtype=dtype),
         "lm_head.weight": rnd(vocab, h)}
    for L in range(args.num_layers):
        p = f"model.layers.{L}."
        w.update({p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                  p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                  p + "self_attn.q_proj.weight": rnd(dq, h), p + "self_attn.k_proj.weight": rnd(dkv, h),
                  p + "self_attn.v_proj.weight": rnd(dkv, h), p + "self_attn.o_proj.weight": rnd(h, dq),
                  p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
                  p + "mlp.down_proj.weight": rnd(h, i)})
    base.args, base.weights, base.name = args, w, f"random-llama-{shape}"
    base.source = None  # no file behind these weights: nothing of theirs is kept in the tuning cache
    return base


def make_engine(loaded, batch: int, prompt: int, out: int, device: str):
    import engine.engine as eng
    from engine import EngineConfig, LLMEngine

    cfg = EngineConfig(device=device, max_running_requests=batch, enable_prefix_caching=False, max_model_len=prompt + out + 32,
                       max_total_num_tokens=batch * (prompt + out + 32) + 256,
                       kv_cache_tokens=batch * (prompt + out + 32) + 256, max_num_batched_tokens=max(2048, batch * prompt))
    if loaded is None:
        return LLMEngine(cfg)
    real = eng.load_model
    # The engine consumes the weight dicts it is given (freeing each layer's source as it goes).
    eng.load_model = lambda path: dataclasses.replace(loaded, weights=dict(loaded.weights),
                                                      q4_blocks=dict(loaded.q4_blocks))
    try:
        return LLMEngine(cfg)
    finally:
        eng.load_model = real


def weight_bytes(model) -> int:
    n = 0
    for layer in model.layers:
        n += layer.attn_norm.nbytes + layer.mlp_norm.nbytes
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            scale = getattr(lin, "scale", None)
            n += lin.weight.nbytes + (scale.nbytes if isinstance(scale, torch.Tensor) else 0)
    return n + model.lm_head.weight.nbytes + model.norm.nbytes


def run(engine, batch: int, prompt: int, out: int, device: str) -> tuple[float, float]:
    """(decode tokens/s, bound tokens/s) for `batch` requests of `prompt` tokens generating `out` each."""
    from engine import EngineRequest, SamplingParams

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = [(7 * j + 3 * r) % 1000 + 100 for r in range(batch) for j in range(prompt)]
    reqs = [EngineRequest(f"r{r}", ids[r * prompt:(r + 1) * prompt],
                          SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)) for r in range(batch)]
    for r in reqs:
        engine.add_request(r)
    st = engine.stats
    dec_time, dec_tokens, ctx_sum = 0.0, 0, 0
    while engine.has_unfinished():
        p0, d0 = st.prefill_tokens, st.decode_tokens
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        dt = time.perf_counter() - t0
        if st.prefill_tokens == p0 and st.decode_tokens > d0:
            n = st.decode_tokens - d0
            dec_time += dt
            dec_tokens += n
            ctx_sum += n * (prompt + out // 2)
    r = engine.runner
    mean_ctx = ctx_sum / max(1, dec_tokens)
    step_bytes = weight_bytes(r.model) + batch * mean_ctx * r.kv_bytes_per_token
    return dec_tokens / max(dec_time, 1e-9), batch * HBM_BYTES_PER_S / step_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run")
        return 2
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    prompt, out = (8, 4) if a.dry_run else (128, 128)
    batches = (1, 4) if a.dry_run else (1, 32, 128)
    models = [("SmolLM2-135M", None), ("random Llama-1B shape" if not a.dry_run else "random tiny Llama",
                                       lambda: random_llama("tiny" if a.dry_run else "1b", device, dtype))]
    modes = ["torch", "auto"] if not a.dry_run else ["torch"]
    print(f"engine decode on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; prompt {prompt}, "
          f"{out} new tokens per request; bound = batch x 4.8 TB/s / (weights + batch x KV context)")
    for name, make in models:
        loaded = make() if make else None
        for mode in modes:
            os.environ["SLUICE_KERNELS"] = mode
            for b in batches:
                eng = make_engine(loaded, b, prompt, out, device)
                run(eng, min(b, 2), 4, 2, device)  # warm-up
                tps, bound = run(eng, b, prompt, out, device)
                print(f"  {name:<24} kernels={mode:<5} batch {b:>3}: {tps:9.1f} decode tok/s   bound {bound:10.0f}"
                      f"   {tps / bound:6.1%} of bound")
                del eng
                if device == "cuda":
                    torch.cuda.empty_cache()
    if a.dry_run:  # the engine end to end through the Triton kernels (interpreted): tiny model, 2 requests
        os.environ["SLUICE_KERNELS"] = "triton"
        eng = make_engine(random_llama("tiny", device, dtype), 2, 6, 3, device)
        tps, _ = run(eng, 2, 6, 3, device)
        os.environ["SLUICE_KERNELS"] = "torch"
        print(f"  random tiny Llama        kernels=triton (interpreted) batch 2: ran, {tps:.1f} decode tok/s")
    os.environ.pop("SLUICE_KERNELS", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
