"""The engine core: a library driven by a loop (`add_request`, `step`, `abort`), as in vLLM v1.

It knows nothing of HTTP, queues or tiers; a worker thread or process drives it. Not thread-safe:
call it from one thread.
"""

from __future__ import annotations

import logging
import os
import random
import time

from . import memory
from .block_manager import BlockManager
from .config import EngineConfig, EngineConfigError, output_room
from .guide import CompileTicket, GuideLimits, Guides, GuideStats
from .loader import load_model
from .model_runner import ModelRunner
from .output import OutputProcessor
from .request import EngineRequest, RequestOutput, RequestRejected
from .sampler import Sampled
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A step longer than this is logged (the scheduler bounds steps well below it; lower it to watch a bench).
SLOW_STEP_S = float(os.environ.get("SLUICE_SLOW_STEP_S", "1.0"))
COMPILE_POLL_S = 0.005  # how long an otherwise idle step waits for a grammar to finish compiling


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        config.validate_basic()
        t0 = time.perf_counter()
        with memory.loading():  # the file's parsing and the torch path's copies: mapped, unmapped when freed
            loaded = load_model(config.model)
        self.model_name = config.served_model_name or loaded.name
        self.tokenizer = Tokenizer(loaded)
        self.eos_token_ids = loaded.eos_token_ids
        self.generation_defaults = dict(loaded.generation_defaults)
        self.max_model_len = config.max_model_len or loaded.args.max_position_embeddings
        if self.max_model_len > loaded.args.max_position_embeddings:
            raise EngineConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's context length "
                f"{loaded.args.max_position_embeddings}")
        self.stats = EngineStats()
        vocab = loaded.args.vocab_size  # the logits' width
        self.guides = Guides(self.tokenizer.to_json, vocab, self.eos_token_ids, self.stats.guide,
                             limits=GuideLimits(compile_timeout_s=config.guide_compile_timeout_s,
                                                max_spec_bytes=config.guide_max_spec_bytes,
                                                max_object_properties=config.guide_max_object_properties),
                             tokenizer_at_start=config.guide_tokenizer_at_start)
        self.max_token_id = min(vocab, self.tokenizer.vocab_size) - 1  # ids a request may name
        self.runner = ModelRunner(config, loaded, self.guides)
        del loaded
        memory.release_freed_memory()  # the loader's float32 copies (~0.5 GB for the default model)
        self.capacity_tokens = self.runner.num_blocks * config.block_size
        self.max_input_len = validate_limits(config, self.max_model_len, self.capacity_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.step_cost = self.runner.measure_step_cost(self.max_model_len)
        self.scheduler = Scheduler(config, self.block_manager, cost=self.step_cost)
        self._seqs: dict[str, Sequence] = {}
        self._compiling: dict[str, tuple[Sequence, CompileTicket]] = {}  # guided, waiting for their grammar
        self._noise_seeds = random.Random(config.seed)
        self._outputs: dict[str, OutputProcessor] = {}
        runner = self.runner
        log.info("engine: model %s on %s (%s, weights %s), KV pool %d tokens in %d blocks of %d "
                 "(%.1f MiB %s, resident as used), max_running_requests %d, loaded in %.1fs",
                 self.model_name, runner.device, str(runner.dtype).removeprefix("torch."), runner.describe_weights(),
                 self.capacity_tokens, self.runner.num_blocks, config.block_size,
                 self.capacity_tokens * self.runner.kv_bytes_per_token / 2**20,
                 str(self.runner.kv_dtype).removeprefix("torch."), config.max_running_requests,
                 time.perf_counter() - t0)

    # -- the loop's API --------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self._seqs:
            raise RequestRejected(f"request id {req.request_id} is already running", code="duplicate_request")
        prompt_len = len(req.prompt_token_ids)
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty", param="messages")
        if prompt_len > self.max_input_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens (at most "
                f"{self.max_input_len} for the prompt); your prompt has {prompt_len} tokens.",
                code="context_length_exceeded", param="messages")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary", param="prompt")
        try:
            req.sampling.validate()
        except ValueError as e:
            raise RequestRejected(str(e)) from e
        bad = [t for t in req.sampling.stop_token_ids if not 0 <= t <= self.max_token_id]
        if bad:
            raise RequestRejected(f"stop token id {bad[0]} is outside the vocabulary", param="stop_token_ids")
        bad = [t for t in req.sampling.logit_bias if not 0 <= t <= self.max_token_id]
        if bad:
            raise RequestRejected(f"logit_bias token id {bad[0]} is outside the vocabulary", param="logit_bias")
        if prompt_len >= self.capacity_tokens:
            raise RequestRejected(
                f"the prompt ({prompt_len} tokens) cannot fit in this engine's KV pool of "
                f"{self.capacity_tokens} tokens", code="context_length_exceeded", param="messages")
        max_tokens = req.sampling.max_tokens
        room = self.max_output_tokens(prompt_len)
        if max_tokens > room:
            raise RequestRejected(self._no_room(max_tokens, prompt_len, room), code="context_length_exceeded",
                                  param="max_tokens")
        seq = Sequence.from_request(req, max_tokens, self.eos_token_ids)
        if req.sampling.seed is None:  # the noise of unseeded requests: from the engine's seeded stream
            seq.noise_seed = self._noise_seeds.getrandbits(62)
        if seq.num_new_outputs < 0 or len(seq.output_token_ids) >= max_tokens:
            raise RequestRejected("the resumed tokens already reach max_tokens", param="max_tokens")
        self._seqs[req.request_id] = seq
        self._outputs[req.request_id] = OutputProcessor(seq, self.tokenizer)
        if req.sampling.guide is None:
            self.scheduler.add(seq)
            return
        # Compiled on the grammar thread (a resumed request replays its tokens into its new matcher); the
        # sequence is scheduled once its grammar is ready, so a grammar that cannot be used is a
        # rejection (at once when the cache knows it), never an error inside step().
        ticket = self.guides.submit(req.sampling.guide, seq.output_token_ids)
        if ticket.done:
            try:
                seq.guide = ticket.matcher()
            except RequestRejected:
                del self._seqs[req.request_id], self._outputs[req.request_id]
                raise
            self.scheduler.add(seq)
        else:
            self._compiling[req.request_id] = (seq, ticket)

    def max_output_tokens(self, prompt_len: int) -> int:
        """The largest `max_tokens` this engine takes with a prompt of `prompt_len` tokens: what the
        context, the KV pool and req_max_output_len leave. A larger one is refused, never shortened, so
        a request gets the budget it asked for or an error that says why."""
        return output_room(prompt_len, self.max_model_len, self.capacity_tokens, self.config.req_max_output_len)

    def _no_room(self, max_tokens: int, prompt_len: int, room: int) -> str:
        limits = [f"a context of {self.max_model_len} tokens"]
        if self.capacity_tokens < self.max_model_len:
            limits.append(f"a KV pool of {self.capacity_tokens} tokens")
        if self.config.req_max_output_len is not None:
            limits.append(f"req_max_output_len {self.config.req_max_output_len}")
        return (f"max_tokens {max_tokens} cannot fit: with a prompt of {prompt_len} tokens this engine "
                f"({', '.join(limits)}) has room for at most {room} output tokens. Lower max_tokens.")

    def kv_usage(self) -> float:
        """The share of the KV pool's blocks that sequences hold (cached prefix blocks nobody holds count
        as free: a new request may take them)."""
        bm = self.block_manager
        return (bm.num_blocks - bm.num_free_blocks) / bm.num_blocks

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        self._outputs.pop(request_id, None)
        if self._compiling.pop(request_id, None) is not None:
            return
        if seq is not None:
            self.scheduler.remove(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._compiling)

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens admitted and not yet computed (waiting, compiling, or mid-prefill): the prefill
        work ahead of a new request's first token. A racy read from another thread is fine (routing)."""
        seqs = [*list(self.scheduler.waiting), *list(self.scheduler.running)]
        n = sum(s.num_uncomputed for s in seqs if s.is_prefilling)
        return n + sum(len(seq.prompt_token_ids) for seq, _ in list(self._compiling.values()))

    def _take_compiled(self, outputs: list[RequestOutput]) -> None:
        """Guided requests whose grammar is ready join the scheduler; those refused (or over the compile
        budget) end with a 400-class error output that names the grammar."""
        for rid, (seq, ticket) in list(self._compiling.items()):
            if not ticket.done:
                continue
            del self._compiling[rid]
            try:
                seq.guide = ticket.matcher()
            except RequestRejected as e:
                del self._seqs[rid], self._outputs[rid]
                outputs.append(RequestOutput(request_id=rid, finished=True, finish_reason="error", error=str(e),
                                             error_code=e.code, error_param=e.param,
                                             prompt_tokens=len(seq.prompt_token_ids)))
                continue
            self.scheduler.add(seq)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, apply the sampled tokens (scheduler), then turn them into text."""
        outputs: list[RequestOutput] = []
        started = time.perf_counter()
        if self._compiling:
            self._take_compiled(outputs)
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if not sched.scheduled:
            if self._compiling and not outputs:  # only grammars on their way: wait for one, do not spin
                self.guides.compiled.wait(COMPILE_POLL_S)
                self.guides.compiled.clear()
            return outputs
        t0 = time.perf_counter()
        try:
            sampled = self.runner.execute(sched.scheduled)
        except Exception:
            log.exception("a step of %d requests failed; retrying each alone", len(sched.scheduled))
            sampled = self._isolate_failure(sched.scheduled, outputs)
        took = time.perf_counter() - t0
        self.stats.record_step(sched, took)
        if took > SLOW_STEP_S:
            log.warning("slow step: %.2f s for %d tokens (%d decodes, chunks %s; predicted %.0f ms)", took,
                        sched.num_tokens, sched.num_decodes, sorted(n for n in sched.scheduled.values() if n > 1),
                        1e3 * (self.step_cost.base + sched.cost))
        self.scheduler.update_from_output(sched, {seq: s.token for seq, s in sampled.items()})
        for seq, s in sampled.items():
            proc = self._outputs[seq.request_id]
            if proc.push(s.token, s.logprob):
                self.scheduler.finish(seq, "stop")
            out = proc.output()
            if seq.finish_reason is not None:
                del self._seqs[seq.request_id]
                del self._outputs[seq.request_id]
            if out is not None:
                outputs.append(out)
        # The whole step, scheduling and output processing included: what the streams wait for each token.
        self.scheduler.observe(sched, time.perf_counter() - started)
        return outputs

    def _isolate_failure(self, scheduled: dict[Sequence, int],
                         outputs: list[RequestOutput]) -> dict[Sequence, Sampled]:
        """After a failed step: run each sequence's part of it alone; the ones that fail again are
        finished with an error, so one bad request never takes the rest of the batch down with it.
        The runner writes nothing to the sequences, so each retry computes exactly the tokens of the
        failed step (rewriting their K/V slots with the same values is harmless)."""
        sampled: dict[Sequence, Sampled] = {}
        for seq, n in scheduled.items():
            try:
                sampled.update(self.runner.execute({seq: n}))
            except Exception as e:
                log.exception("request %s fails a step on its own; finishing it with an error", seq.request_id)
                self.abort(seq.request_id)
                outputs.append(RequestOutput(
                    request_id=seq.request_id, finished=True, finish_reason="error",
                    error=f"this request failed inside the engine ({type(e).__name__}); "
                          "other requests were not affected",
                    prompt_tokens=len(seq.prompt_token_ids), completion_tokens=len(seq.output_token_ids)))
        return sampled

    # -- convenience -------------------------------------------------------------------------------
    def prompt_logits(self, token_ids: list[int]):
        """float32 logits [len(token_ids), vocab] at every position, through the same paged path
        (for correctness tests against a reference implementation)."""
        seq = Sequence.from_request(EngineRequest("__logits__", token_ids), max_tokens=1)
        if not self.block_manager.can_grow(seq, len(token_ids)):
            raise RequestRejected("not enough free KV blocks to score this prompt now")
        self.block_manager.grow(seq, len(token_ids))
        try:
            return self.runner.logits_for(seq, len(token_ids))
        finally:
            self.block_manager.free_sequence(seq)

    def generate(self, requests: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
        """Run requests to completion (tests, benchmarks, offline use)."""
        results: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.add_request(r)
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].append(out)
        return results


def validate_limits(c: EngineConfig, max_model_len: int, capacity_tokens: int) -> int:
    """Checks the scheduling limits against the model and the KV pool; returns the longest prompt.

    Every value that cannot be honoured is an EngineConfigError naming the setting to change."""
    max_input_len = c.req_max_input_len or max_model_len - 1
    if max_input_len >= max_model_len:
        raise EngineConfigError(
            f"req_max_input_len {max_input_len} leaves no room to generate within max_model_len "
            f"{max_model_len}; set it below {max_model_len}")
    if c.req_max_input_len is not None and c.req_max_input_len + 1 > capacity_tokens:
        raise EngineConfigError(
            f"req_max_input_len {c.req_max_input_len} cannot fit in the KV pool of {capacity_tokens} tokens; "
            "raise kv_cache_tokens / max_total_num_tokens (or mem_fraction_static on a GPU) or lower "
            "req_max_input_len")
    if capacity_tokens // c.block_size < c.max_running_requests:
        raise EngineConfigError(
            f"max_running_requests {c.max_running_requests} needs at least one KV block each, but the pool "
            f"has {capacity_tokens // c.block_size} blocks of {c.block_size} tokens; raise kv_cache_tokens / "
            "max_total_num_tokens (or mem_fraction_static on a GPU) or lower max_running_requests")
    if c.max_num_batched_tokens < c.max_running_requests:
        raise EngineConfigError(
            f"max_num_batched_tokens {c.max_num_batched_tokens} is below max_running_requests "
            f"{c.max_running_requests}: a step could not give every running request its decode token")
    if c.chunked_prefill_size > c.max_num_batched_tokens:
        raise EngineConfigError(
            f"chunked_prefill_size {c.chunked_prefill_size} exceeds max_num_batched_tokens "
            f"{c.max_num_batched_tokens}; lower it or raise the token budget")
    if c.chunked_prefill_size <= 0 and c.max_num_batched_tokens < max_input_len:
        raise EngineConfigError(
            "without chunked prefill (chunked_prefill_size <= 0) max_num_batched_tokens must hold the "
            f"longest prompt ({max_input_len} tokens); raise it, lower req_max_input_len, or enable chunking")
    if capacity_tokens < max_model_len:
        log.warning("KV pool (%d tokens) is smaller than the context (%d): longer requests are refused",
                    capacity_tokens, max_model_len)
    return max_input_len


class EngineStats:
    """Counters a worker can export: steps, tokens, preemptions, time spent stepping (for the busy ratio),
    and constrained decoding's grammar compiles and token masks (`guide`: counts and host seconds)."""

    def __init__(self) -> None:
        self.guide = GuideStats()
        self.steps = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.busy_seconds = 0.0
        self.preemptions = 0

    def record_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """One step that ran (before the scheduler applies it: a decode is a sequence computing its last token)."""
        self.steps += 1
        self.busy_seconds += seconds
        for seq, n in sched.scheduled.items():
            if n == 1 and not seq.is_prefilling:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += n
