"""Text to token ids exactly as the model's sentence-transformers pipeline makes them.

The model's tokenizer.json brings its normalizer (BERT: lowercasing, accent and whitespace cleanup),
its word pieces and its post-processor, which frames every input with special tokens ([CLS] ... [SEP]
for BERT). The padding and truncation that file may carry are dropped: the engine packs inputs
without padding, and decides on truncation itself, to `max_seq_length` with the frame kept, as
sentence-transformers truncates. Special-token strings in a text are matched as the reference matches
them (an embedding has no turns a user could forge, and equal vectors need equal tokens).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class EncoderTokenizer:
    """Pure and thread-safe after construction."""

    def __init__(self, tokenizer_json: str | Path, max_seq_length: int, do_lower_case: bool = False):
        self._tok = HFTokenizer.from_file(str(tokenizer_json))
        self._tok.no_padding()
        self._tok.no_truncation()
        self._cut = HFTokenizer.from_str(self._tok.to_str())
        self._cut.enable_truncation(max_seq_length)
        self.max_seq_length = max_seq_length
        self.do_lower_case = do_lower_case
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        probe = self._tok.encode("a")
        mask = probe.special_tokens_mask
        head = next((i for i, m in enumerate(mask) if not m), len(mask))
        tail = next((i for i, m in enumerate(reversed(mask)) if not m), 0)
        self.prefix_ids, self.suffix_ids = probe.ids[:head], probe.ids[len(mask) - tail:]

    def vocab(self) -> dict[str, int]:
        """Every token's piece (word pieces continuing a word start with ##) -> its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Each text's ids, framed by the special tokens; cut to max_seq_length only when `truncate`
        (otherwise an input may be longer, for the engine to refuse by its index)."""
        texts = [t.strip() for t in texts]  # as sentence-transformers' Transformer module does
        if self.do_lower_case:
            texts = [t.lower() for t in texts]
        tok = self._cut if truncate else self._tok
        return [e.ids for e in tok.encode_batch(texts)]

    def truncate(self, ids: list[int]) -> list[int]:
        """Token ids cut to max_seq_length as the tokenizer cuts text: an input framed by the special
        tokens keeps its frame and loses the end of its content; any other keeps its first ids."""
        n = self.max_seq_length
        if len(ids) <= n:
            return ids
        head, tail = len(self.prefix_ids), len(self.suffix_ids)
        framed = ids[:head] == self.prefix_ids and (tail == 0 or ids[-tail:] == self.suffix_ids)
        if not framed or head + tail >= n:
            return ids[:n]
        return ids[:n - tail] + ids[len(ids) - tail:]
