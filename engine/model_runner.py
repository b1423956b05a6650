"""Owns the model weights and the KV pool; turns `{sequence: num_tokens}` into one forward and sampled tokens.

It only reads the sequences (tokens, progress, block tables); the scheduler applies what a step did.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import time

import torch

import kernels.cpu as cpu_kernels
from kernels import AttentionMetadata

from . import memory
from .config import EngineConfig
from .cpu_plan import ROW_CANDIDATES, CpuKernels, Plan, wide_thresholds
from .cuda_graphs import DecodeGraphs
from .gguf_blocks import DECODERS
from .guide import Guides
from .loader import LoadedModel
from .model import LlamaModel
from .sampler import Sampled, sample
from .sequence import Sequence
from .step_cost import StepCost
from .tuning_cache import TuningCache, machine_key
from .weights import int4_available

log = logging.getLogger(__name__)

# The step cost model's timing at start: a chunk of this many tokens at position 0 and from position DEEP.
KEPT = " (kept from an earlier start: engine/tuning_cache.py)"
STEP_COST_CHUNK = 64
STEP_COST_DEEP = 1024
STEP_COST_REPEATS = 3
STEP_COST_MIN_DEEP = 256

# What the start-up timing of the native step's matmuls runs: a chat-sized context, and a few layers (the
# time per layer is what matters, every mode repeats it per layer), except for steps of up to
# NATIVE_TIMING_ALL_LAYERS_ROWS rows: those are bound by streaming the weights from memory, while a few
# layers' weights sit in cache, so they are timed over every layer. (On the AVX2 build, a Xeon, when its
# int8 columns still went through a decoded buffer: one row of SmolLM2 Q4_K_M over 3 layers timed int16
# 0.71 ms / int8 0.70, and int8 was chosen, where the whole step took 8.1 / 9.0-9.4 ms; the random
# Llama-3.2-1B shape's 44.4 / 54.2.)
NATIVE_TIMING_LAYERS = 3
NATIVE_TIMING_ALL_LAYERS_ROWS = 4
NATIVE_TIMING_CONTEXT = 256


def pick_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto" and config.deterministic:
        return torch.float32
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def pick_weight_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype of the (non-4-bit) linear weights."""
    if config.weight_dtype == "auto" and config.deterministic:
        return torch.float32
    if config.weight_dtype in ("auto", "int4"):
        return torch.bfloat16
    return _DTYPES[config.weight_dtype]


def use_int4(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> bool:
    """int4: the model file's 4-bit blocks, read by torch's CPU int4 matmul (auto: whenever both exist)."""
    if config.weight_dtype not in ("auto", "int4") or config.deterministic:
        return False
    ok = bool(loaded.q4_blocks) and int4_available(device)
    if config.weight_dtype == "int4" and not ok:
        log.warning("weight_dtype int4: %s; using bfloat16 weights",
                    "the model has no Q4_0/Q4_1 weights" if not loaded.q4_blocks else
                    f"no int4 matmul for device {device.type} in this torch")
    return ok


def pick_kv_dtype(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                  weight_dtype: torch.dtype) -> torch.dtype:
    if config.kv_cache_dtype != "auto":
        return _DTYPES[config.kv_cache_dtype]
    if device.type == "cpu" and weight_dtype != torch.float32 and not config.deterministic:
        return torch.bfloat16
    return dtype


def kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool. On a CPU it lives in an anonymous memory map: the kernel hands out zero pages
    lazily, so a page becomes resident only when a block in it is first written and the process holds
    the KV memory in use, not the pool's capacity (torch.zeros would touch every page at start)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps `buf` alive through the buffer protocol for as long as it exists.
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


# the GGUF types the native CPU step reads (Q4_0/Q4_1 in the loader, the others engine/gguf_blocks.py)
NATIVE_TYPES = ("Q4_0", "Q4_1", *DECODERS, "F16", "BF16")


def native_refusal(loaded: LoadedModel, eligible: bool) -> str:
    """Why a CPU that has the native step does not run it on this model, in words for the start-up log."""
    other = {t: n for t, n in loaded.layer_types.items() if t not in NATIVE_TYPES}
    half = {t for t in loaded.layer_types if t in ("F16", "BF16")}
    if not other and half and half != set(loaded.layer_types):
        return "it does not mix 16-bit (F16/BF16) and quantised matrices in one file"
    if other:
        total = sum(loaded.layer_types.values())
        kinds = ", ".join(f"{t} ({n})" for t, n in sorted(other.items(), key=lambda kv: -kv[1]))
        return (f"it reads {', '.join(NATIVE_TYPES)} layer weights, and {sum(other.values())} of this file's "
                f"{total} are {kinds}")
    if not loaded.layer_types:
        return "the model is not a GGUF file of quantised blocks"
    if not eligible:
        return "the configuration asks for another path (int4 off, or a KV cache or dtype other than bf16/fp32)"
    return "the model's shapes are ones it does not take"


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, guides: Guides | None = None):
        self.config = config
        self.guides = guides  # constrained decoding: the token masks of guided sequences
        self.device = pick_device(config)
        self.dtype = pick_dtype(config, self.device)
        # Native CPU kernels or not, their threads and AMX rows: decided here, once, for the model and the sampler.
        self.kernels = CpuKernels.decide(self.device)
        args = loaded.args
        # Start-up timings kept from an earlier start of this model and configuration on this machine.
        self.tuning = TuningCache.from_env()
        self._model_key = None if loaded.source is None else {"model": loaded.source, "args": repr(args)}
        self.weight_dtype = pick_weight_dtype(config)
        self.int4 = use_int4(config, loaded, self.device)
        self.kv_dtype = pick_kv_dtype(config, self.device, self.dtype, self.weight_dtype)
        # The native step reads the file's blocks (4-bit, or the other types engine/gguf_blocks.py decodes)
        # wherever weight_dtype leaves the choice to the file (auto, int4).
        blocks_ok = (config.weight_dtype in ("auto", "int4") and not config.deterministic
                     and (self.int4 or bool(loaded.group_blocks)))
        native = (self.kernels.native and blocks_ok and self.kv_dtype == torch.bfloat16
                  and self.dtype == torch.float32 and config.native_cpu_step)
        with memory.loading():  # the repacking's temporaries: mapped, unmapped when freed (not held at the peak)
            self.model = LlamaModel(args, loaded.weights, self.dtype, self.device, self.weight_dtype,
                                    deterministic=config.deterministic,
                                    q4_blocks=loaded.q4_blocks if self.int4 else None,
                                    native_block_size=config.block_size if native else 0, kernels=self.kernels,
                                    group_blocks=loaded.group_blocks if native else None,
                                    head_bits=config.output_layer_bits)
        self.int4_max_rows = 0  # steps of up to this many tokens read the 4-bit weights
        if self.kernels.native and config.native_cpu_step and self.model.native is None:
            log.info("native CPU forward step not used: %s; every step takes the torch path, weights %s",
                     native_refusal(loaded, native), str(self.weight_dtype).removeprefix("torch."))
        if self.device.type == "cpu" and not config.deterministic and self.model.native is None:
            self._plan_cpu_steps()  # (the native step's plan, its AMX threshold, is `_plan_native`)
        if config.deterministic:
            log.info("deterministic: batch-invariant matmuls and attention, no CUDA graphs, weights %s, "
                     "activations %s (outputs do not depend on batching, chunking or prefix-cache hits)",
                     str(self.weight_dtype).removeprefix("torch."), str(self.dtype).removeprefix("torch."))
        self.block_size = config.block_size
        kv_bytes_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * self.kv_dtype.itemsize
        self.num_blocks = num_blocks = self._pool_blocks(kv_bytes_per_token)
        # One extra block past the pool: the scratch block that CUDA-graph padding rows write to.
        self.scratch_block = num_blocks
        self.kv_cache = kv_pool((args.num_layers, 2, (num_blocks + 1) * self.block_size, args.num_kv_heads,
                                 args.head_dim), self.kv_dtype, self.device)
        self.kv_bytes_per_token = kv_bytes_per_token
        if self.model.native is not None:
            self._plan_native()
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graph_max_batch > 0 and not config.deterministic:
            max_len = config.max_model_len or args.max_position_embeddings
            max_batch = min(config.cuda_graph_max_batch, config.max_running_requests)
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, -(-max_len // self.block_size),
                                       self.scratch_block, max_batch, max_len)

    def describe_weights(self) -> str:
        """What the weights a step reads are, for the start-up log and the benches."""
        if self.model.native is not None:
            tiles = " and ".join(f"{k} ({n})" for k, n in self.model.native.tile_formats().items())
            head = "4-bit" if isinstance(self.model.head_tiles, cpu_kernels.LayerTiles) else "int8"
            return f"layers in {tiles} tiles, {head} output layer (native CPU step)"
        return str(self.weight_dtype).removeprefix("torch.") + (
            f" + int4 up to {self.int4_max_rows} tokens" if self.int4 else "")

    def _plan_cpu_steps(self) -> None:
        """Which weights (packed low-bit or dense) and how many threads each step size uses, measured
        here at start (engine/cpu_plan.py) or kept from an earlier start (engine/tuning_cache.py), and logged."""
        cfg, model = self.config, self.model
        threads = self.kernels.threads
        forced = cfg.int4_max_batch if model.has_packed else None
        times: dict[str, str] = {}

        def measure() -> tuple[Plan, Plan]:
            times.update(model.plan_cpu_steps(threads, forced))
            assert model.layer_plan is not None and model.head_plan is not None
            return model.layer_plan, model.head_plan

        (layers, head), kept = self.tuning.remember(
            "cpu-plan", self._tuning_key(forced_packed_rows=forced), measure,
            lambda plans: [p.to_json() for p in plans], lambda d: (Plan.from_json(d[0]), Plan.from_json(d[1])))
        model.layer_plan, model.head_plan = layers, head
        self.int4_max_rows = layers.packed_max_rows() if forced is None else forced
        log.info("CPU steps (%d threads): layers %s; output layer %s%s", threads, layers.describe(),
                 head.describe(), KEPT if kept else "")
        if times:
            log.debug("CPU step timings: %s", times)

    def _tuning_key(self, **measured: object) -> dict[str, object] | None:
        """What a start-up timing depends on: the machine, the model, the runner's choices and `measured`
        (what the timed steps were). None (not kept) for a model with no file behind it."""
        if self._model_key is None:
            return None
        cfg = self.config
        native = self.model.native
        return {**machine_key(str(self.device)), **self._model_key, "threads": self.kernels.threads,
                "dtype": str(self.dtype), "weights": str(self.weight_dtype), "kv": str(self.kv_dtype),
                "int4": self.int4, "native": native.library if native is not None else None,
                "deterministic": cfg.deterministic, "block_size": cfg.block_size,
                "head": self.describe_weights(), **measured}

    def _plan_native(self) -> None:
        """From how many rows the native step takes its int8 matmul, and from how many its AMX one (CPUs
        with AMX): configured, or timed against its int16 matmul on the first layers with a synthetic
        context, at the kernels' thread count. A configured wide_min_rows of 0 means int16 for every step
        (rows computed alike whatever the batch), so no AMX either unless amx_min_rows is set."""
        model, cfg, kernels = self.model, self.config, self.kernels
        native = model.native
        assert native is not None
        modes = ["int16"] + (["int8"] if native.wide else []) + (["amx"] if native.amx else [])
        kept = False
        configured = cfg.wide_min_rows is not None and (cfg.amx_min_rows is not None or not native.amx
                                                        or cfg.wide_min_rows == 0)
        if len(modes) == 1:
            kernels.wide_min_rows = kernels.amx_min_rows = 0
        elif configured:
            kernels.wide_min_rows = (cfg.wide_min_rows or 0) if native.wide else 0
            kernels.amx_min_rows = (cfg.amx_min_rows or 0) if native.amx else 0
        else:
            # Every size a step can have, not only up to max_running_requests: a prefill chunk has up to
            # max_num_batched_tokens rows whatever the batch. A pool too small for that many sequences at the
            # timing context times them at a shorter one (attention costs the same in every mode).
            contexts = {r: min(NATIVE_TIMING_CONTEXT, self.num_blocks // r * self.block_size) for r in ROW_CANDIDATES
                        if r <= cfg.max_num_batched_tokens}
            rows = [r for r, ctx in contexts.items() if ctx >= self.block_size]
            thresholds = {"int16": (0, 0), "int8": (1, 0), "amx": (0, 1)}

            layers = {r: self.model.args.num_layers if r <= NATIVE_TIMING_ALL_LAYERS_ROWS else
                      min(NATIVE_TIMING_LAYERS, self.model.args.num_layers) for r in rows}

            def time_step(b: int, mode: str) -> float:
                step = self._synthetic_decode(b, contexts[b])
                t = time.perf_counter()
                self.model.hidden(*step, num_layers=layers[b], wide_rows=thresholds[mode])
                return time.perf_counter() - t

            measured = [m for m in modes if m != "amx" or cfg.amx_min_rows is None]

            def measure() -> tuple[int, int]:
                int8, amx, times = wide_thresholds(time_step, measured, rows)
                log.debug("native CPU step, matmul times (ms; layers timed: %s): %s", layers,
                          {r: {k: round(v * 1e3, 2) for k, v in t.items()} for r, t in times.items()})
                return int8, amx

            key = self._tuning_key(rows=rows, context=[contexts[r] for r in rows], layers=[layers[r] for r in rows],
                                   modes=measured)
            (kernels.wide_min_rows, kernels.amx_min_rows), kept = self.tuning.remember(
                "wide-rows", key, measure, list, lambda v: (int(v[0]), int(v[1])))
            # a configured value wins over the measured one for its own mode
            if cfg.wide_min_rows is not None:
                kernels.wide_min_rows = cfg.wide_min_rows if native.wide else 0
            if cfg.amx_min_rows is not None:
                kernels.amx_min_rows = cfg.amx_min_rows if native.amx else 0
        said = []
        if kernels.wide_min_rows:
            said.append(f"{native.wide} matmuls from {kernels.wide_min_rows} rows")
        if kernels.amx_min_rows:
            said.append(f"AMX bf16 tiles from {kernels.amx_min_rows} rows")
        text = ("; ".join(said) if said else "no AMX or int8 matmul in this build" if len(modes) == 1 else
                "int16 matmuls for every step")
        if len(modes) > 1 and not configured and kept:
            text += KEPT
        log.info("native CPU forward step (kernels/cpu, %s, %d threads) for every step; %s; its layer weights "
                 "%d MiB", native.isa, kernels.threads, text, native.nbytes() // 2**20)

    def _synthetic_decode(self, rows: int, context: int) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """A decode step of `rows` sequences of `context` tokens over the pool's first blocks (for timing
        at start, before any request holds a block; what it writes there is overwritten before use)."""
        return self._synthetic_step([1] * rows, [context - 1] * rows)

    def _synthetic_step(self, query_lens: list[int], starts: list[int]) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """A step of sequences computing `query_lens[i]` tokens from position `starts[i]` (decodes, those
        of one token, first), over the pool's first blocks, sampling each sequence's last row."""
        bs = self.block_size
        seq_lens = [s + q for s, q in zip(starts, query_lens)]
        blocks = -(-max(seq_lens) // bs)
        tables = torch.arange(len(query_lens) * blocks, dtype=torch.int32).view(len(query_lens), blocks)
        positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, query_lens)])
        row_seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        slots = tables[row_seq, positions // bs].long() * bs + positions % bs
        qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        num_decodes = sum(q == 1 for q in query_lens)
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=qsl, num_decodes=num_decodes, block_size=bs, query_lens_host=list(query_lens),
            seq_lens_host=seq_lens, max_decode_len=max(seq_lens[:num_decodes], default=0))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=meta.slot_mapping.to(dev), block_tables=meta.block_tables.to(dev),
            seq_lens=meta.seq_lens.to(dev), query_start_loc=meta.query_start_loc.to(dev), num_decodes=num_decodes,
            block_size=bs, query_lens_host=meta.query_lens_host, seq_lens_host=seq_lens,
            max_decode_len=meta.max_decode_len)
        return ((positions % 1000 + 100).to(dev), positions.to(dev), self.kv_cache, meta,
                (qsl[1:] - 1).long().to(dev))

    def measure_step_cost(self, max_model_len: int, chunk: int = STEP_COST_CHUNK,
                          deep: int = STEP_COST_DEEP) -> StepCost:
        """The scheduler's cost model, timed here on synthetic steps (`StepCost.measure`: a one-row decode,
        a chunk at position 0 and the same chunk deep in a context, in turns; a term near 0, as the best
        of separate runs sometimes gave, lets a long prompt's deep chunks take most of every step). The
        default model (token counts) where the context or the pool is too small to hold a deep chunk."""
        deep = min(deep, max_model_len - chunk, self.num_blocks * self.block_size - chunk)
        if deep < STEP_COST_MIN_DEEP:
            return StepCost()

        steps = {"one": self._synthetic_step([1], [15]), "zero": self._synthetic_step([chunk], [0]),
                 "deep": self._synthetic_step([chunk], [deep])}

        def timed(kind: str) -> float:
            t = time.perf_counter()
            self.model.logits(self.model.hidden(*steps[kind]))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - t

        plans = {"layers": self.model.layer_plan.describe() if self.model.layer_plan else None,
                 "wide_min_rows": self.kernels.wide_min_rows, "amx_min_rows": self.kernels.amx_min_rows}
        cost, kept = self.tuning.remember(
            "step-cost", self._tuning_key(chunk=chunk, deep=deep, repeats=STEP_COST_REPEATS, **plans),
            lambda: StepCost.measure(timed, chunk, deep, STEP_COST_REPEATS), dataclasses.asdict,
            lambda d: StepCost(**{**d, "seconds": True}))  # (entries from before the field: measured too)
        log.info("step cost model (scheduler): %s%s", cost.describe(), KEPT if kept else "")
        return cost

    def _pool_blocks(self, bytes_per_token: int) -> int:
        cfg = self.config
        if cfg.max_total_num_tokens is not None:
            tokens = cfg.max_total_num_tokens
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            fraction = cfg.mem_fraction_static if cfg.mem_fraction_static is not None else 0.85
            tokens = int(free * fraction) // bytes_per_token
        else:
            tokens = cfg.kv_cache_tokens
        return max(1, tokens // cfg.block_size)

    def execute(self, scheduled: dict[Sequence, int]) -> dict[Sequence, Sampled]:
        """Runs one forward over every scheduled token; returns the sampled token (and its logprobs,
        when asked) of each sequence whose last uncomputed token was in this step (partial prefill
        chunks sample nothing). Running it again before the scheduler applies the step recomputes the
        same tokens."""
        logits, hidden, samplers = self._forward(scheduled)
        if not samplers:
            return {}
        logits = self._exact_for_logprobs(logits, hidden, samplers)
        return dict(zip(samplers, sample(logits, samplers, self.guides, self.kernels)))

    def _exact_for_logprobs(self, logits: torch.Tensor, hidden: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """With the bf16 output layer only each row's top candidates are exact: rows that want logprobs
        get all their logits recomputed at full precision (a new tensor; graph outputs stay untouched)."""
        if not self.model.approximate_logits:
            return logits
        rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
        if not rows:
            return logits
        idx = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return logits.index_copy(0, idx, self.model.logits(hidden.index_select(0, idx), exact=True))

    def logits_for(self, seq: Sequence, n: int) -> torch.Tensor:
        """Logits at every one of the sequence's next n positions (tests and scoring)."""
        logits, _, _ = self._forward({seq: n}, all_logits=True)
        return logits

    def _forward(self, scheduled: dict[Sequence, int],
                 all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]]:
        """(logits, final hidden states, the sequences that sample, in row order)."""
        if (self.graphs is not None and not all_logits and all(n == 1 for n in scheduled.values())
                and self.graphs.bucket_for(len(scheduled)) is not None):
            return self._forward_graph(scheduled)
        return self._forward_eager(scheduled, all_logits)

    def _forward_graph(self, scheduled: dict[Sequence, int]) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]]:
        """A pure decode step: every sequence computes its one newest token and samples."""
        assert self.graphs is not None
        bs = self.block_size
        seqs = list(scheduled)
        positions = [s.num_computed_tokens for s in seqs]
        logits, hidden = self.graphs.run(
            tokens=[s.token_ids(p, p + 1)[0] for s, p in zip(seqs, positions)], positions=positions,
            slots=[s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)],
            block_tables=[s.block_table for s in seqs], seq_lens=[p + 1 for p in positions])
        return logits, hidden, seqs

    def _forward_eager(self, scheduled: dict[Sequence, int],
                       all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]]:
        # Decodes (one token) first, then prefill chunks: the layout the attention op expects.
        order = sorted(scheduled.items(), key=lambda kv: kv[1] > 1)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        samplers: list[Sequence] = []
        num_decodes = 0
        bs = self.block_size
        for seq, n in order:
            start = seq.num_computed_tokens
            num_decodes += n == 1
            tokens += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_lens.append(n)
            seq_lens.append(start + n)
            if all_logits:
                logits_idx += range(len(tokens) - n, len(tokens))
            if start + n == seq.num_tokens:
                if not all_logits:
                    logits_idx.append(len(tokens) - 1)
                samplers.append(seq)
        max_blocks = max(len(s.block_table) for s, _ in order)
        # one tensor from padded lists (a tensor and a slice copy per sequence took 84 us at 16 sequences)
        tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s, _ in order],
                              dtype=torch.int32)
        dev = self.device
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            num_decodes=num_decodes, block_size=bs, query_lens_host=query_lens, seq_lens_host=seq_lens,
            max_decode_len=max(seq_lens[:num_decodes], default=0),
        )
        hidden = self.model.hidden(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                                   self.kv_cache, meta, torch.tensor(logits_idx, dtype=torch.long, device=dev))
        return self.model.logits(hidden, exact=all_logits), hidden, samplers
