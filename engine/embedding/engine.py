"""The embedding engine: a library driven by a loop (`add_request`, `step`, `abort`), like `LLMEngine`.

It knows nothing of HTTP, queues or tiers; a worker drives it from one thread (it is not thread-safe).
A request is refused at `add_request` (RequestRejected, naming the field and the input at fault) or
served to the end: nothing it sent can fail a step later.
"""

from __future__ import annotations

import logging
import time
from itertools import chain

import torch
import torch.nn.functional as F

from ..config import EngineConfigError
from ..request import RequestRejected
from .bert import Bert, PackedBatch
from .config import EmbeddingConfig
from .loader import load_encoder
from .pooling import pool
from .precision import resolve_dtype
from .request import EmbeddingOutput, EmbeddingRequest
from .scheduler import EmbeddingScheduler, Pending, Step
from .tokenizer import EncoderTokenizer

log = logging.getLogger(__name__)


class EmbeddingEngine:
    """What a caller reads besides the loop: `model_name`, `max_input_tokens` (the longest input, special
    tokens included), `dimensions` (the vectors' length), `supports_dimensions`, `stats`; `tokenize`
    turns texts into a request's inputs."""

    def __init__(self, config: EmbeddingConfig | None = None):
        self.config = config = config or EmbeddingConfig()
        config.validate_basic()
        t0 = time.perf_counter()
        loaded = load_encoder(config.model)
        self.model_name = config.served_model_name or loaded.name
        self.model_path = loaded.path  # the sentence-transformers folder (the reference loads the same one)
        if config.max_seq_length is not None and config.max_seq_length > loaded.max_seq_length:
            raise EngineConfigError(f"max_seq_length {config.max_seq_length} exceeds the model's "
                                    f"{loaded.max_seq_length}")
        self.max_input_tokens = config.max_seq_length or loaded.max_seq_length
        if config.max_batch_tokens < self.max_input_tokens:
            raise EngineConfigError(f"max_batch_tokens {config.max_batch_tokens} cannot hold the longest input "
                                    f"({self.max_input_tokens} tokens); raise it or lower max_seq_length")
        self.dimensions = loaded.args.hidden_size  # the vectors' length
        self.supports_dimensions = config.supports_dimensions
        self.pooling, self.normalize = loaded.pooling, loaded.normalize
        self.tokenizer = EncoderTokenizer(loaded.tokenizer_json, self.max_input_tokens, loaded.do_lower_case)
        self.vocab_size = loaded.args.vocab_size
        self.device = torch.device(config.device if config.device != "auto" else
                                   "cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = resolve_dtype(config.dtype, self.device, loaded.args.hidden_size)
        self.model = Bert(loaded.args, loaded.weights, self.device, self.dtype, rows=config.max_batch_tokens)
        del loaded
        self.scheduler = EmbeddingScheduler(config.max_batch_tokens, config.priority_aging_s,
                                            interactive_batch_tokens=config.interactive_batch_tokens,
                                            interactive_window_s=config.interactive_window_s)
        self.stats = EmbeddingStats()
        log.info("embedding engine: model %s on %s (%s%s), %d dimensions, %s pooling%s, max %d tokens an "
                 "input, %d a step, loaded in %.1fs", self.model_name, self.device,
                 str(self.dtype).removeprefix("torch."), ", fused oneDNN linears" if self.model.fused else "",
                 self.dimensions, self.pooling,
                 ", normalised" if self.normalize else "", self.max_input_tokens, config.max_batch_tokens,
                 time.perf_counter() - t0)

    # -- the caller's side ---------------------------------------------------------------------------
    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Texts to the ids a request carries (special tokens included); cut to max_input_tokens only
        when `truncate` (otherwise add_request refuses what is too long, naming the input)."""
        return self.tokenizer.encode(texts, truncate=truncate)

    # -- the loop's API ------------------------------------------------------------------------------
    def add_request(self, req: EmbeddingRequest) -> None:
        if req.request_id in self.scheduler.pending:
            raise RequestRejected(f"request id {req.request_id} is already running", code="duplicate_request")
        if not req.inputs:
            raise RequestRejected("the input is empty: send at least one input", param="input")
        if req.dimensions is not None:
            if not self.supports_dimensions:
                raise RequestRejected(f"the model {self.model_name} does not support dimensions", param="dimensions")
            if not 1 <= req.dimensions <= self.dimensions:
                raise RequestRejected(f"dimensions must be between 1 and {self.dimensions}, got {req.dimensions}",
                                      param="dimensions")
        inputs = []
        for i, ids in enumerate(req.inputs):
            if not ids:
                raise RequestRejected(f"input {i} is empty", param="input")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise RequestRejected(f"input {i}: token id {bad} is outside the vocabulary", param="input")
            if len(ids) > self.max_input_tokens:
                if not req.truncate:
                    raise RequestRejected(
                        f"input {i} has {len(ids)} tokens, more than this model's maximum of "
                        f"{self.max_input_tokens}; shorten it or ask for truncation",
                        code="context_length_exceeded", param="input")
                ids = self.tokenizer.truncate(ids)
            inputs.append(ids)
        self.scheduler.add(req.request_id, inputs, req.priority, time.monotonic(), req.dimensions)

    def abort(self, request_id: str) -> None:
        self.scheduler.remove(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_pending()

    # -- what a worker reports (the chat engine's names, so one worker drives either engine) ------------
    @property
    def num_running(self) -> int:
        """Requests with inputs still to embed."""
        return len(self.scheduler.pending)

    @property
    def num_waiting(self) -> int:
        return 0  # nothing waits for memory: a request's inputs are embedded as steps reach them

    def kv_usage(self) -> float:
        return 0.0  # no KV cache

    def pending_tokens(self) -> dict[int, int]:
        """Tokens of the inputs not yet embedded, by priority: the work ahead of a new request (a step
        serves one priority, the best first)."""
        out: dict[int, int] = {}
        for p in self.scheduler.pending.values():
            out[p.priority] = out.get(p.priority, 0) + sum(len(p.inputs[i]) for i in p.order[p.taken:])
        return out

    def step(self) -> list[EmbeddingOutput]:
        """Embed the next step's inputs; one output per input, the request's last one `finished`."""
        step = self.scheduler.schedule(time.monotonic())
        if not step.rows:
            return []
        t0 = time.perf_counter()
        try:
            vectors = self.embed_ids([p.inputs[i] for p, i in step.rows])
        except Exception:
            log.exception("an embedding step of %d inputs failed; retrying each request alone", len(step.rows))
            return self._isolate_failure(step)
        took = time.perf_counter() - t0
        self.scheduler.served(step, time.monotonic())
        self.stats.record(step, took)
        return self._outputs(step.rows, vectors)

    def _outputs(self, rows: list[tuple[Pending, int]], vectors: torch.Tensor) -> list[EmbeddingOutput]:
        outputs = []
        shorter = any(p.dimensions is not None for p, _ in rows)
        values = [v.tolist() for v in self._shortened(rows, vectors)] if shorter else vectors.tolist()
        for (p, i), vec in zip(rows, values):
            p.left -= 1
            outputs.append(EmbeddingOutput(p.request_id, i, vec, len(p.inputs[i]), finished=p.left == 0))
        return outputs

    def _shortened(self, rows: list[tuple[Pending, int]], vectors: torch.Tensor) -> list[torch.Tensor]:
        """Each row at its request's `dimensions` (the first d values, normalised again when the model
        normalises)."""
        out = []
        for (p, _), vec in zip(rows, vectors):
            if p.dimensions is not None and p.dimensions < vec.numel():
                vec = vec[:p.dimensions]
                vec = F.normalize(vec, dim=0) if self.normalize else vec
            out.append(vec)
        return out

    def _isolate_failure(self, step: Step) -> list[EmbeddingOutput]:
        """After a failed step: each request's rows run alone; a request that fails again ends with an
        error output, so one bad request never takes the others down with it."""
        outputs: list[EmbeddingOutput] = []
        by_request: dict[str, list[tuple[Pending, int]]] = {}
        for p, i in step.rows:
            by_request.setdefault(p.request_id, []).append((p, i))
        for rid, rows in by_request.items():
            try:
                outputs += self._outputs(rows, self.embed_ids([p.inputs[i] for p, i in rows]))
            except Exception as e:
                log.exception("embedding request %s fails a step on its own; finishing it with an error", rid)
                self.abort(rid)
                outputs.append(EmbeddingOutput(rid, -1, finished=True, error=(
                    f"this request failed inside the engine ({type(e).__name__}); other requests were not affected")))
        self.scheduler.served(step, time.monotonic())
        return outputs

    # -- the forward ---------------------------------------------------------------------------------
    def embed_ids(self, inputs: list[list[int]]) -> torch.Tensor:
        """float32 [len(inputs), dimensions] on the CPU: the inputs in one forward, as given (no limits
        checked: the scheduler's steps are within them)."""
        batch = PackedBatch.of([len(ids) for ids in inputs], self.device)
        input_ids = torch.tensor(list(chain.from_iterable(inputs)), dtype=torch.int64, device=self.device)
        hidden = self.model.forward(input_ids, batch)
        return pool(hidden, batch.cu_seqlens, self.pooling, self.normalize).cpu()

    def embed(self, texts: list[str], truncate: bool = True) -> torch.Tensor:
        """Texts to vectors through the engine's own batching (tests, benchmarks, offline use), on an idle
        engine: its loop would take other requests' outputs."""
        if self.has_unfinished():
            raise RuntimeError("embed() needs an idle engine; drive requests in flight with step()")
        ids = self.tokenize(texts, truncate=truncate)
        req = EmbeddingRequest("__embed__", ids)
        self.add_request(req)
        out = torch.empty(len(texts), self.dimensions)
        while self.has_unfinished():
            for o in self.step():
                if o.error is not None:
                    raise RuntimeError(o.error)
                out[o.index] = torch.tensor(o.embedding)
        return out


class EmbeddingStats:
    """Counters a worker can export: steps, inputs and tokens embedded, and time spent stepping."""

    def __init__(self) -> None:
        self.steps = 0
        self.inputs = 0
        self.tokens = 0
        self.busy_seconds = 0.0

    def record(self, step: Step, seconds: float) -> None:
        self.steps += 1
        self.inputs += len(step.rows)
        self.tokens += step.num_tokens
        self.busy_seconds += seconds
