"""What each choice of an answer produced so far (`ChoiceAcc`) and the `usage` object they add up to
(`TokenUsage`): the JSON answer, the streamed chunks and the relay that counts billed tokens all read
these, whichever backend served the request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import RequestOutput, TokenLogprob
from gateway.openai.schema import PromptTokensDetails, Usage


@dataclass
class ChoiceAcc:
    """What one choice produced so far."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    finished: bool = False
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason


@dataclass(frozen=True)
class TokenUsage:
    """The `usage` object of an answer."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, accs: list[ChoiceAcc]) -> TokenUsage:
        return cls(prompt_tokens, sum(a.completion_tokens for a in accs),
                   max((a.cached_tokens for a in accs), default=0))

    def as_dict(self) -> dict[str, object]:
        """Equal to `Usage(...).model_dump()`."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def model(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    def json(self) -> bytes:
        return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":' \
               b'{"cached_tokens":%d}}' % (self.prompt_tokens, self.completion_tokens,
                                           self.prompt_tokens + self.completion_tokens, self.cached_tokens)
