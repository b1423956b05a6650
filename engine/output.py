"""Turns each sequence's new tokens into text deltas and finds stop strings.

The scheduler has already appended the token and applied the stop tokens and the output limit; this
only detokenizes, reports a stop string (the engine then finishes the sequence) and decides how much
text may be sent. Stop strings are never emitted, even when a stop string is split across tokens:
text that could be the start of a stop string is held back until it is either completed (and cut) or
ruled out.
"""

from __future__ import annotations

from .guide import clean_error
from .request import RequestOutput, TokenLogprob
from .sequence import Sequence
from .tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, seq: Sequence, tokenizer: Tokenizer):
        self.seq = seq
        self.stops = [s for s in seq.sampling.stop if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        # Context: the prompt's tail and any resumed tokens, so the first delta keeps its leading space.
        self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids[-6:] + seq.output_token_ids)
        self.text = ""  # all text produced by this engine for the request (after resumed tokens)
        self.emitted = 0  # characters of `text` already sent
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []  # aligned with pending_ids when the request wants them

    def push(self, token_id: int, logprob: TokenLogprob | None = None) -> bool:
        """Detokenizes a sampled token (a stop token adds no text). True when the text now holds a stop
        string: the text is cut where it starts and the sequence must finish with "stop"."""
        self.pending_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        if token_id in self.seq.stop_token_ids:
            return False
        self.text += self.detok.push([token_id])
        if not self.stops:
            return False
        search_from = max(0, self.emitted - self.max_stop)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def output(self) -> RequestOutput | None:
        """The news since the last output: all remaining text once the sequence has finished, else the
        text that cannot be the start of a stop string (None while there is nothing to send: an
        incomplete UTF-8 character or a possible stop string)."""
        seq = self.seq
        finished = seq.finish_reason is not None
        end = len(self.text) if finished else len(self.text) - self._held_back()
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        if not delta and not finished:
            return None
        self.emitted = max(self.emitted, end)
        ids, self.pending_ids = self.pending_ids, []
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        error = code = param = None
        if seq.finish_reason == "error" and seq.guide is not None and seq.guide.error is not None:
            # The grammar hit llguidance's per-step limits or an error state: the request's own fault.
            error, code, param = f"constrained decoding failed: {clean_error(seq.guide.error)}", "invalid_grammar", \
                "response_format"
        return RequestOutput(request_id=seq.request_id, text=delta, token_ids=ids, finished=finished,
                             finish_reason=seq.finish_reason, prompt_tokens=len(seq.prompt_token_ids),
                             completion_tokens=len(seq.output_token_ids), cached_tokens=seq.num_cached_tokens,
                             error=error, error_code=code, error_param=param,
                             logprobs=logprobs if seq.sampling.logprobs is not None else None)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if not self.stops:
            return 0
        text = self.text
        for n in range(min(self.max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
