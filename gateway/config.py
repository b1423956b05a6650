"""Gateway settings: code defaults < TOML file < `SLUICE_*` env vars < CLI flags.

The TOML file is `$SLUICE_CONFIG`, else `config/sluice.toml` in the working directory when it exists,
else none (code defaults only). Env vars use `__` for nesting: `SLUICE_SERVER__PORT=9000`.
The `engine` section is an open dict forwarded verbatim as `EngineConfig(**engine)`, so the gateway does
not have to mirror every engine knob (the engine validates them at start).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from gateway.remote_config import LimitSettings, ProviderSettings, RoutingSettings
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_CONFIG_PATH = Path("config/sluice.toml")


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


class ModelSettings(BaseModel):
    path: str | None = None  # None: the engine's default model (SmolLM2-135M-Instruct)
    served_model_name: str | None = None  # the id clients use; None: the engine's model_name


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
    engine: dict[str, Any] = Field(default_factory=dict)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    tiers: dict[str, TierSettings] = Field(default_factory=_default_tiers)
    # None: the in-process queue (one process). Set (env SLUICE_REDIS_URL): the Redis queue, shared by
    # every gateway and `sluice worker` of a deployment.
    redis_url: str | None = None
    # Remote providers, routing and per-key limits (gateway/remote_config.py, issue 5).
    providers: list[ProviderSettings] = Field(default_factory=list)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)

    @field_validator("tiers")
    @classmethod
    def _tiers_not_empty(cls, v: dict[str, TierSettings]) -> dict[str, TierSettings]:
        if not v:
            raise ValueError("at least one tier must be configured")
        return v

    def tier_priority(self, tier: str) -> int:
        return self.tiers[tier].priority

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
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = settings_cls.model_config.get("toml_file")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


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
