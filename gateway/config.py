"""Gateway settings: code defaults < TOML file < `SLUICE_*` env vars < CLI flags.

The TOML file is `$SLUICE_CONFIG`, else `config/sluice.toml` in the working directory when it exists,
else none (code defaults only). Env vars use `__` for nesting: `SLUICE_SERVER__PORT=9000`.
The `engine` section is an open dict forwarded verbatim as `EngineConfig(**engine)`, so the gateway does
not have to mirror every engine knob (the engine validates them at start).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
