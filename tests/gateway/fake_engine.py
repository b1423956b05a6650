"""A tiny engine that honours the engine contract without torch, for fast queue/worker/app tests.

Tokens are characters (ord); a request "generates" its prompt back, cycling, one token per step,
so outputs are deterministic and easy to check. `gate` (a threading.Event) can stall step() to
hold requests in flight; `fail_next_step` makes one step raise.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from engine import EngineRequest, RequestOutput, RequestRejected


class FakeTokenizer:
    vocab_size = 0x110000

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.encode(text)

    def token_pieces(self) -> dict[int, str]:
        return {}  # no byte-level vocabulary: a token's text and bytes come from decoding it


@dataclass
class FakeStats:
    busy_seconds: float = 0.0  # time spent in step() past the gate, as the real engine counts its steps


@dataclass
class FakeConfig:
    max_running_requests: int = 4


@dataclass
class _Seq:
    req: EngineRequest
    generated: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(self, max_running_requests: int = 4, max_model_len: int = 256, step_s: float = 0.0,
                 output_room: int | None = None):
        """`output_room`: a cap on every request's output (as a KV pool or req_max_output_len makes one);
        with it, a larger max_tokens is refused as the real engine refuses it (without it, tests may
        ask for any budget, to keep a request running)."""
        self.config = FakeConfig(max_running_requests)
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.output_room = output_room
        self.tokenizer = FakeTokenizer()
        self.generation_defaults: dict[str, float] = {}
        self.stats = FakeStats()
        self.step_s = step_s
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next_step = False
        self.running: dict[str, _Seq] = {}
        self.waiting: list[_Seq] = []
        self.aborted: list[str] = []
        self.added: list[str] = []
        self.threads: set[int] = set()  # every thread that called into the engine

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, req: EngineRequest) -> None:
        self._touch()
        if len(req.prompt_token_ids) >= self.max_model_len:
            raise RequestRejected("prompt too long", code="context_length_exceeded", param="messages")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:  # as the real engine: a token id outside the vocabulary is the request's fault
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary", param="prompt")
        if req.sampling.max_tokens == 999_999:  # a magic value to exercise the rejection path
            raise RequestRejected("rejected on purpose", code="fake_rejection", param="max_tokens")
        if self.output_room is not None and req.sampling.max_tokens > self.max_output_tokens(len(req.prompt_token_ids)):
            raise RequestRejected("max_tokens cannot fit", code="context_length_exceeded", param="max_tokens")
        self.added.append(req.request_id)
        # Resumed tokens (a retry after another worker died) count as generated and are not re-emitted.
        self.waiting.append(_Seq(req, generated=list(req.resume_token_ids)))

    def abort(self, request_id: str) -> None:
        self._touch()
        self.aborted.append(request_id)
        self.running.pop(request_id, None)
        self.waiting = [s for s in self.waiting if s.req.request_id != request_id]

    def max_output_tokens(self, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        return room if self.output_room is None else min(room, self.output_room)

    def kv_usage(self) -> float:
        return 0.0  # no KV pool

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.gate.wait()
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats.busy_seconds += time.perf_counter() - t0

    def _step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        if self.step_s:
            time.sleep(self.step_s)
        while self.waiting and len(self.running) < self.config.max_running_requests:
            s = self.waiting.pop(0)
            self.running[s.req.request_id] = s
        outs = []
        for rid, s in list(self.running.items()):
            prompt = s.req.prompt_token_ids
            tok = prompt[len(s.generated) % len(prompt)]
            s.generated.append(tok)
            done = len(s.generated) >= s.req.sampling.max_tokens
            outs.append(RequestOutput(request_id=rid, text=chr(tok), token_ids=[tok], finished=done,
                                      finish_reason="length" if done else None,
                                      prompt_tokens=len(prompt), completion_tokens=len(s.generated)))
            if done:
                del self.running[rid]
        return outs
