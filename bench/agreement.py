"""How close the native CPU step's next-token distributions are to the float path's on the same file: mean KL
(reference || native) and top-1 agreement over every position of a few prompts, the logits as sampling sees
them (the output layer's int8 or 4-bit candidate pass, each row's best 16 made exact). The reference is the
torch path with every weight dequantised to float32, activations float32.

    python -m bench.agreement --model /tmp/llama32-1b-Q4_K_M.gguf [--output-layer-bits 4] [--wide-min-rows 0]
"""

from __future__ import annotations

import argparse

import torch

from bench.vs_llamacpp import machine
from engine import EngineConfig, LLMEngine

PROMPTS = ["The history of the printing press begins in", "def quicksort(items):\n    if len(items) <= 1:",
           "Write one sentence about the sea, then list three fruits and say why each is good for you.",
           "In 1969 the first people walked on the Moon. The mission was called"]


def kl_and_top1(ref: torch.Tensor, ours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(ref || ours) of the softmaxes, and whether the argmaxes agree."""
    p, q = ref.double().log_softmax(-1), ours.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1), ref.argmax(-1) == ours.argmax(-1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the packaged model)")
    ap.add_argument("--output-layer-bits", type=int, choices=(4, 8), default=None)
    ap.add_argument("--wide-min-rows", type=int, default=None, help="0: int16 matmuls only (default: measured)")
    ap.add_argument("--amx-min-rows", type=int, default=None,
                    help="CPUs with AMX: steps of at least this many rows on AMX tiles (0: never; default: measured)")
    a = ap.parse_args(argv)
    print(f"machine: {machine()}")
    native = LLMEngine(EngineConfig(model=a.model, kv_cache_tokens=4096, max_running_requests=4,
                                    output_layer_bits=a.output_layer_bits, wide_min_rows=a.wide_min_rows,
                                    amx_min_rows=a.amx_min_rows))
    print(f"native: {native.runner.describe_weights()}")
    model = native.runner.model
    exact_logits = model.logits
    # as sampling sees them: scoring asks for exact logits (as logprobs do), decoding takes the candidate pass
    model.logits = lambda h, exact=False: exact_logits(h)  # type: ignore[method-assign]
    ids = [native.tokenizer.encode(p) for p in PROMPTS]
    ours = [native.prompt_logits(t).cpu() for t in ids]
    del native
    ref_engine = LLMEngine(EngineConfig(model=a.model, kv_cache_tokens=4096, max_running_requests=4, dtype="float32",
                                        weight_dtype="float32", native_cpu_step=False))
    ref = [ref_engine.prompt_logits(t).cpu() for t in ids]
    kl, agree = (torch.cat(x) for x in zip(*(kl_and_top1(r, o) for r, o in zip(ref, ours))))
    print(f"{len(kl)} positions: mean KL {kl.mean().item():.5f} (max {kl.max().item():.4f}), "
          f"top-1 agreement {agree.float().mean().item():.1%}")


if __name__ == "__main__":
    main()
