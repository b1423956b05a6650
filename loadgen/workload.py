"""What `sluice bench` sends: request bodies, their lengths, and which tier (API key) sends each.

Three shapes, each deterministic in (seed, request index), so two runs with the same seed send the
same requests:

* synthetic: a prompt of `input_len` words and `max_tokens = output_len`, lengths drawn from a
  distribution (`fixed:N`, `uniform:LO:HI`, `lognormal:MEDIAN:SIGMA`). Prompts are built from short
  common English words, each one token in the usual BPE vocabularies (with its leading space), so a
  prompt of N words is close to N tokens (plus the chat template's few);
* rag: `docs` documents of `doc_len` words shared by many questions: each request is one document (the
  system message, the shared prefix) and a question of `input_len` words of its own;
* jsonl: recorded requests, one OpenAI chat request body per line, sent in order (cycled), from the
  first line at every level.

For `--endpoint embeddings` (SyntheticEmbeddings) a request is an embeddings body: `input` is a list
of `inputs_per_request` texts, each of `input_len` words drawn as for a synthetic prompt (1 for a
search query, 64 or more for ingesting documents).

Level n of a sweep sends indices n * LEVEL_STRIDE + 0, 1, ...: synthetic and rag levels never repeat
the prompts of the level before (which a prefix cache would answer), and level n of two runs with the
same seed sends the same requests.

A tier mix (`pro=0.3,standard=0.7`) assigns each request a tier, drawn with those weights; the tier
picks the API key it is sent with.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Short, frequent words: one token each (with the leading space) in GPT-2, Llama and Qwen vocabularies.
WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not "
    "but what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make than "
    "first been its who now people my made over did down only way find use may water long little very "
    "after words called just where most know get through back much before go good new write our used me "
    "man too any day same right look think also around another came come work three word must because "
    "does part even place well such here take why things help put years different away again off went "
    "old number great tell men say small every found still between name should home big give air line "
    "set own under read last never us left end along while might next sound below saw something thought "
    "both few those always looked show large often together asked house world going want school important "
    "until form food keep children feet land side without boy once animals life enough took sometimes four "
    "head above kind began almost live page got earth need far hand high year mother light parts country "
    "father let night following picture being study second eyes soon times story boys since white days "
    "ever paper hard near sentence better best across during today others however sure means knew try "
    "told young miles sun ways thing whole hear example heard several change answer room sea against top"
).split()


LEVEL_STRIDE = 1_000_000


class WorkloadError(ValueError):
    """A workload that cannot be built (a bad distribution, a bad JSONL line, an unknown tier)."""


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `fixed:N` (or just `N`), `uniform:LO:HI` (inclusive), or
    `lognormal:MEDIAN:SIGMA` (exp of a normal with that median and log-space sigma, clipped to
    [1, 16 * MEDIAN])."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                parts = ["fixed", parts[0]]
            kind, nums = parts[0].lower(), [float(p) for p in parts[1:]]
        except ValueError:
            raise WorkloadError(f"bad length {text!r}: fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA") from None
        if kind == "fixed" and len(nums) == 1 and nums[0] >= 0 and nums[0] == int(nums[0]):
            return cls("fixed", nums[0])
        if kind == "uniform" and len(nums) == 2 and 0 <= nums[0] <= nums[1] and all(n == int(n) for n in nums):
            return cls("uniform", nums[0], nums[1])
        if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
            return cls("lognormal", nums[0], nums[1])
        raise WorkloadError(f"bad length {text!r}: fixed:N, uniform:LO:HI (integers, LO <= HI) or "
                            "lognormal:MEDIAN:SIGMA (MEDIAN >= 1)")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        value = math.exp(rng.gauss(math.log(self.a), self.b))
        return max(1, min(round(value), int(16 * self.a)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}"


def words(rng: random.Random, n: int) -> str:
    """n words drawn from WORDS, space-separated (about n tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def count_words(messages: object) -> int:
    """Whitespace-separated words in a chat body's messages (text parts only)."""
    total = 0
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += len(part["text"].split())
    return total


class TierMix:
    """Weights by tier name; `pick` draws one. A single tier (or none given) always picks it."""

    def __init__(self, weights: dict[str, float]):
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise WorkloadError("a tier mix needs at least one tier with a positive weight")
        total = sum(weights.values())
        self.weights = {t: w / total for t, w in weights.items()}

    @classmethod
    def parse(cls, text: str) -> TierMix:
        """`pro=0.3,standard=0.7` (weights need not add up to 1)."""
        weights: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, sep, value = item.partition("=")
            try:
                if not sep or not name.strip():
                    raise ValueError
                weights[name.strip()] = float(value)
            except ValueError:
                raise WorkloadError(f"bad tier mix item {item!r}: TIER=WEIGHT, e.g. pro=0.3,standard=0.7") from None
        return cls(weights)

    @property
    def tiers(self) -> list[str]:
        return list(self.weights)

    def pick(self, rng: random.Random) -> str:
        if len(self.weights) == 1:
            return next(iter(self.weights))
        return rng.choices(list(self.weights), weights=list(self.weights.values()))[0]

    def __str__(self) -> str:
        return ",".join(f"{t}={w:g}" for t, w in self.weights.items())


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its index in the run, its tier, and its OpenAI chat body (without the
    `stream` fields, which the client sets) or embeddings body (`model`, `input`: a list of texts)."""

    index: int
    tier: str
    body: dict[str, object]
    prompt_words: int  # all inputs' together for an embeddings body


class Workload(Protocol):
    name: str

    def request(self, index: int) -> RequestSpec: ...

    def describe(self) -> dict[str, object]: ...


def _rng(seed: int, index: int, what: str) -> random.Random:
    return random.Random(f"{seed}/{what}/{index}")  # str seeds are hashed (SHA-512): stable across runs


class Synthetic:
    name = "synthetic"

    def __init__(self, model: str, input_len: LengthDist, output_len: LengthDist, tiers: TierMix, seed: int = 0,
                 extra_body: dict[str, object] | None = None):
        self.model, self.input_len, self.output_len = model, input_len, output_len
        self.tiers, self.seed, self.extra_body = tiers, seed, extra_body or {}

    def request(self, index: int) -> RequestSpec:
        rng = _rng(self.seed, index, "synthetic")
        n_in = max(1, self.input_len.sample(rng))
        n_out = self.output_len.sample(rng)
        body: dict[str, object] = {"model": self.model, "messages": [{"role": "user", "content": words(rng, n_in)}],
                                   "max_tokens": n_out, **self.extra_body}
        return RequestSpec(index, self.tiers.pick(_rng(self.seed, index, "tier")), body, n_in)

    def describe(self) -> dict[str, object]:
        return {"workload": self.name, "model": self.model, "input_len": str(self.input_len),
                "output_len": str(self.output_len)}


class SyntheticEmbeddings:
    """Embeddings bodies: `inputs_per_request` texts of `input_len` words each (drawn per text)."""

    name = "synthetic"

    def __init__(self, model: str, input_len: LengthDist, inputs_per_request: int, tiers: TierMix, seed: int = 0,
                 extra_body: dict[str, object] | None = None):
        if inputs_per_request < 1:
            raise WorkloadError(f"--inputs-per-request {inputs_per_request}: at least 1")
        self.model, self.input_len, self.inputs_per_request = model, input_len, inputs_per_request
        self.tiers, self.seed, self.extra_body = tiers, seed, extra_body or {}

    def request(self, index: int) -> RequestSpec:
        rng = _rng(self.seed, index, "embeddings")
        texts = [words(rng, max(1, self.input_len.sample(rng))) for _ in range(self.inputs_per_request)]
        body: dict[str, object] = {"model": self.model, "input": texts, **self.extra_body}
        return RequestSpec(index, self.tiers.pick(_rng(self.seed, index, "tier")), body,
                           sum(len(t.split()) for t in texts))

    def describe(self) -> dict[str, object]:
        return {"workload": self.name, "endpoint": "embeddings", "model": self.model,
                "input_len": str(self.input_len), "inputs_per_request": self.inputs_per_request}


class Rag:
    """`docs` shared documents (system message) of `doc_len` words; each request adds its own question."""

    name = "rag"

    def __init__(self, model: str, docs: int, doc_len: int, question_len: LengthDist, output_len: LengthDist,
                 tiers: TierMix, seed: int = 0, extra_body: dict[str, object] | None = None):
        if docs < 1 or doc_len < 1:
            raise WorkloadError("rag needs --docs >= 1 and --doc-len >= 1")
        self.model, self.question_len, self.output_len = model, question_len, output_len
        self.doc_len, self.tiers, self.seed, self.extra_body = doc_len, tiers, seed, extra_body or {}
        self.docs = [words(_rng(seed, d, "doc"), doc_len) for d in range(docs)]

    def request(self, index: int) -> RequestSpec:
        rng = _rng(self.seed, index, "rag")
        doc = rng.randrange(len(self.docs))
        n_q = max(1, self.question_len.sample(rng))
        body: dict[str, object] = {
            "model": self.model,
            "messages": [{"role": "system", "content": self.docs[doc]},
                         {"role": "user", "content": words(rng, n_q)}],
            "max_tokens": self.output_len.sample(rng), **self.extra_body}
        return RequestSpec(index, self.tiers.pick(_rng(self.seed, index, "tier")), body, self.doc_len + n_q)

    def describe(self) -> dict[str, object]:
        return {"workload": self.name, "model": self.model, "docs": len(self.docs), "doc_len": self.doc_len,
                "question_len": str(self.question_len), "output_len": str(self.output_len)}


def load_jsonl(path: str | Path) -> list[dict[str, object]]:
    """Chat request bodies, one JSON object per line (blank lines skipped)."""
    bodies: list[dict[str, object]] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise WorkloadError(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise WorkloadError(f"{path}:{n}: not a chat request body (an object with a non-empty \"messages\")")
        bodies.append(body)
    if not bodies:
        raise WorkloadError(f"{path}: no requests")
    return bodies


class Recorded:
    """Recorded chat bodies, sent in file order and cycled. `model` (when given) replaces each body's
    model, and is used where a body has none; `output_len` (when given) replaces its `max_tokens`."""

    name = "jsonl"

    def __init__(self, path: str | Path, tiers: TierMix, model: str | None = None,
                 output_len: LengthDist | None = None, seed: int = 0, extra_body: dict[str, object] | None = None):
        self.path = str(path)
        self.bodies = load_jsonl(path)
        self.model, self.output_len, self.tiers, self.seed = model, output_len, tiers, seed
        self.extra_body = extra_body or {}
        if model is None and any(not isinstance(b.get("model"), str) for b in self.bodies):
            raise WorkloadError(f"{path}: some lines have no \"model\": give --model")

    def request(self, index: int) -> RequestSpec:
        line = (index % LEVEL_STRIDE) % len(self.bodies)  # each level replays the file from its first line
        body = {k: v for k, v in self.bodies[line].items() if k not in ("stream",)}
        if self.model is not None:
            body["model"] = self.model
        if self.output_len is not None:
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = self.output_len.sample(_rng(self.seed, index, "jsonl"))
        body.update(self.extra_body)
        return RequestSpec(index, self.tiers.pick(_rng(self.seed, index, "tier")), body,
                           count_words(body.get("messages")))

    def describe(self) -> dict[str, object]:
        return {"workload": self.name, "dataset": self.path, "lines": len(self.bodies), "model": self.model,
                "output_len": str(self.output_len) if self.output_len else None}
