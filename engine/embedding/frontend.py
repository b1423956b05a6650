"""An embedding model's frontend without its weights: what a gateway whose embedding engines run elsewhere
(`sluice serve --no-engine` in front of `sluice worker --model ID`) needs to tokenize, count and refuse
inputs itself, named and sized as an `EmbeddingEngine` with the same configuration would be."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfigError
from .config import EmbeddingConfig
from .loader import load_encoder
from .tokenizer import EncoderTokenizer


@dataclass
class EmbeddingFrontend:
    model_name: str
    max_input_tokens: int  # the longest input, special tokens included
    dimensions: int
    supports_dimensions: bool
    tokenizer: EncoderTokenizer

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        return self.tokenizer.encode(texts, truncate=truncate)


def load_embedding_frontend(config: EmbeddingConfig) -> EmbeddingFrontend:
    config.validate_basic()
    loaded = load_encoder(config.model, with_weights=False)
    if config.max_seq_length is not None and config.max_seq_length > loaded.max_seq_length:
        raise EngineConfigError(f"max_seq_length {config.max_seq_length} exceeds the model's {loaded.max_seq_length}")
    max_input = config.max_seq_length or loaded.max_seq_length
    return EmbeddingFrontend(model_name=config.served_model_name or loaded.name, max_input_tokens=max_input,
                             dimensions=loaded.args.hidden_size, supports_dimensions=config.supports_dimensions,
                             tokenizer=EncoderTokenizer(loaded.tokenizer_json, max_input, loaded.do_lower_case))
