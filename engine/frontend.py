"""A model's frontend without its weights: what a gateway whose engines run elsewhere (`sluice serve
--no-engine` in front of `sluice worker`s) needs to tokenize, template and budget requests itself.
Loading it reads the model's configuration and tokenizer only."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import EngineConfig, output_room
from .loader import load_model
from .tokenizer import Tokenizer


@dataclass
class Frontend:
    """The model's tokenizer, name, context and sampling defaults, and the output caps that the engines'
    shared configuration states (`max_output_tokens` answers as `LLMEngine.max_output_tokens` does)."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer
    generation_defaults: dict[str, float] = field(default_factory=dict)
    req_max_output_len: int | None = None
    pool_tokens: int | None = None  # the engines' KV pool, where the configuration fixes it

    def max_output_tokens(self, prompt_len: int) -> int:
        return output_room(prompt_len, self.max_model_len, self.pool_tokens, self.req_max_output_len)


def load_frontend(config: EngineConfig) -> Frontend:
    """The frontend of `config.model`, named and sized as an engine with this configuration would be.

    The KV pool is the configuration's own where it fixes one: `max_total_num_tokens`, else
    `kv_cache_tokens` unless the configuration names a CUDA device (there the engines' free memory
    sizes it, which is not known here)."""
    loaded = load_model(config.model, with_weights=False)
    pool = config.max_total_num_tokens
    if pool is None and not config.device.startswith("cuda"):
        pool = config.kv_cache_tokens
    return Frontend(model_name=config.served_model_name or loaded.name,
                    max_model_len=config.max_model_len or loaded.args.max_position_embeddings,
                    tokenizer=Tokenizer(loaded), generation_defaults=dict(loaded.generation_defaults),
                    req_max_output_len=config.req_max_output_len, pool_tokens=pool)
