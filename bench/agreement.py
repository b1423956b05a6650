"""How close the native CPU step's next-token distributions are to the float path's on the same file: mean KL
(reference || native) and top-1 agreement over every position of a few prompts, the logits as sampling sees
them (the output layer's int8 or 4-bit candidate pass, each row's best 16 made exact). The reference is the
torch path with every weight dequantised to float32, activations float32.

    python -m bench.agreement --model /tmp/llama32-1b-Q4_K_M.gguf [--output-layer-bits 4] [--wide-min-rows 0]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import machine
from engine import EngineConfig, LLMEngine

PROMPTS = ["The history of the printing press begins in", "def quicksort(items):\n    if len(items) <= 1:",
           "Write one sentence about the sea, then list three fruits and say why each is good for you.",
           "In 1969 the first people walked on the Moon. The mission was called"]
# --prompts all: these too, 351 positions on SmolLM2's tokenizer (over the first four's 63, each position
# moves top-1 agreement by 1.6 points)
MORE_PROMPTS = ["SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY",
                "Dear team,\n\nThank you all for the work on the release last week. Before we plan the next one,",
                "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. In the first stage,",
                "Q: What is 17 times 23?\nA: Let's work it out step by step. 17 times 20 is 340, and",
                "<html>\n  <head>\n    <title>Weather today</title>\n  </head>\n  <body>\n    <h1>",
                "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
                "The three laws of thermodynamics can be stated simply. First, energy is neither created nor",
                "import numpy as np\n\ndef softmax(x, axis=-1):\n    x = x - x.max(axis=axis, keepdims=True)\n",
                "Translate into French: The train leaves the station at seven o'clock every morning, except on",
                "Rust's borrow checker enforces two rules at compile time: any number of shared references, or",
                "Ingredients: two cups of flour, one teaspoon of salt, a cup of warm water and a spoon of yeast.",
                "The stock market fell sharply on Monday after the central bank announced that interest rates"]


def kl_and_top1(ref: torch.Tensor, ours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(ref || ours) of the softmaxes, and whether the argmaxes agree."""
    p, q = ref.double().log_softmax(-1), ours.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1), ref.argmax(-1) == ours.argmax(-1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the packaged model)")
    ap.add_argument("--prompts", choices=("four", "all"), default="four",
                    help="the first four prompts (63 positions on SmolLM2's tokenizer), or sixteen")
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
    ids = [native.tokenizer.encode(p) for p in PROMPTS + (MORE_PROMPTS if a.prompts == "all" else [])]
    ours = [native.prompt_logits(t).cpu() for t in ids]
    del native
    ref_engine = LLMEngine(EngineConfig(model=a.model, kv_cache_tokens=4096, max_running_requests=4, dtype="float32",
                                        weight_dtype="float32", native_cpu_step=False))
    ref = [ref_engine.prompt_logits(t).cpu() for t in ids]
    kl, agree = (torch.cat(x) for x in zip(*(kl_and_top1(r, o) for r, o in zip(ref, ours))))
    print(f"{len(kl)} positions: mean KL {kl.mean().item():.5f} (max {kl.max().item():.4f}), "
          f"top-1 agreement {agree.float().mean().item():.1%}")
    # how close the calls were: the reference's own margin between its best two tokens at every position, and
    # where the argmaxes differ, how far below the reference's best our choice is in the reference's logits
    r, o = torch.cat(ref).double(), torch.cat(ours).double()
    top2 = r.topk(2, -1).values
    miss = (~agree).nonzero().flatten()
    lost = (r[miss, r[miss].argmax(-1)] - r[miss, o[miss].argmax(-1)]).tolist()
    print(f"reference top-1 margin: median {(top2[:, 0] - top2[:, 1]).median().item():.3f}, "
          f"under 0.05 at {((top2[:, 0] - top2[:, 1]) < 0.05).float().mean().item():.1%} of positions; "
          f"disagreements' margins: {', '.join(f'{x:.3f}' for x in lost) or 'none'}")


if __name__ == "__main__":
    main()
