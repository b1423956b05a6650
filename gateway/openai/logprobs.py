"""The engine's token log-probabilities in OpenAI's two shapes: chat (`token`, `logprob`, `bytes`,
`top_logprobs`) and legacy completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token's text is its own piece of the vocabulary; `bytes` are that piece's raw UTF-8 bytes (a byte-level
BPE token may be part of a multi-byte character, which the text alone cannot show)."""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

from engine import TokenLogprob
from gateway.openai.schema import ChoiceLogprobs, CompletionLogprobs, TokenLogprobOut, TopLogprob


class TokenText(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenPieces:
    """Token id -> (text, bytes), cached: the same few thousand tokens come back all the time."""

    def __init__(self, tokenizer: TokenText, id_to_token: dict[int, str] | None = None):
        self._tok = tokenizer
        self._raw = id_to_token  # byte-level vocabulary pieces, when the tokenizer exposes them
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw = self._raw.get(token_id) if self._raw else None
        decoder = _byte_decoder()
        if raw is not None and all(ch in decoder for ch in raw):
            data = bytes(decoder[ch] for ch in raw)
        else:
            data = self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        out = (data.decode("utf-8", errors="replace"), list(data))
        self._cache[token_id] = out
        return out


def chat_logprobs(pieces: TokenPieces, entries: list[TokenLogprob], top_n: int) -> ChoiceLogprobs:
    content = []
    for e in entries:
        text, raw = pieces.piece(e.token_id)
        tops = []
        for tid, lp in list(zip(e.top_ids, e.top_logprobs))[:top_n]:
            t, b = pieces.piece(tid)
            tops.append(TopLogprob(token=t, logprob=lp, bytes=b))
        content.append(TokenLogprobOut(token=text, logprob=e.logprob, bytes=raw, top_logprobs=tops))
    return ChoiceLogprobs(content=content)


def completion_logprobs(pieces: TokenPieces, entries: list[TokenLogprob], top_n: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    tokens, values, tops, offsets = [], [], [], []
    pos = text_offset
    for e in entries:
        text, _ = pieces.piece(e.token_id)
        tokens.append(text)
        values.append(e.logprob)
        offsets.append(pos)
        pos += len(text)
        tops.append({pieces.piece(tid)[0]: lp for tid, lp in list(zip(e.top_ids, e.top_logprobs))[:top_n]})
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops if top_n else None,
                              text_offset=offsets)
