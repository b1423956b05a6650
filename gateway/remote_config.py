"""Settings for remote providers, routing, per-key limits and pricing (issue 5).

They live here, not in `config.py`, so the remote side can grow without touching the core settings;
`Settings` only names the sections (`providers`, `routing`, `limits`). Provider API keys are never
written in a config file: `api_key_env` names the environment variable that holds the key.

```toml
[[providers]]
name = "holysheep"
base_url = "https://api.holysheep.ai/v1"
api_key_env = "HOLYSHEEP_API_KEY"
models = { "SmolLM2-135M-Instruct" = "gpt-4o-mini", "deepseek-chat" = "deepseek-chat" }
input_price_per_m = 0.15     # money per million prompt tokens
output_price_per_m = 0.60    # money per million completion tokens
timeout_s = 30
max_concurrent = 256
order = 0                    # lower is tried first
```
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


class RoutingSettings(BaseModel):
    overflow: bool = True  # send local traffic remote when the local side cannot meet the tier's target
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


class KeyLimits(BaseModel):
    rpm: int | None = Field(None, ge=1)  # requests per minute
    tpm: int | None = Field(None, ge=1)  # tokens (prompt + completion) per minute
    budget: float | None = Field(None, ge=0)  # money; requests are refused once spent >= budget


class LimitSettings(BaseModel):
    redis_url: str | None = None  # shared counters across gateways; None: the queue's Redis, else memory
    keys: dict[str, KeyLimits] = Field(default_factory=dict)  # by key name; overrides the tier's limits
    tiers: dict[str, KeyLimits] = Field(default_factory=dict)  # per-tier defaults for every key
