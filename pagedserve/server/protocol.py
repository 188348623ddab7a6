"""OpenAI request bodies (with vLLM's extra sampling fields) and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

MAX_N = 64
_I32 = 2**31 - 1


def _bad_string(obj, path: str, depth: int = 0) -> str | None:
    """The path of the first string (or key) in a decoded JSON value that is not valid
    Unicode text (a lone surrogate such as "\\ud800" cannot be encoded as UTF-8)."""
    if isinstance(obj, str):
        if obj.isascii():
            return None
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if depth > 64:
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if isinstance(k, str) and k.isascii() else f"{path}.<key>"
            if isinstance(k, str) and _bad_string(k, path) is not None:
                return f"{path}.<key>"
            bad = _bad_string(v, sub, depth + 1)
            if bad is not None:
                return bad
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad = _bad_string(v, f"{path}[{i}]", depth + 1)
            if bad is not None:
                return bad
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        if isinstance(data, dict):
            for key, value in data.items():
                if _bad_string(key, "body") is not None:
                    where, name = "a body key", None
                else:
                    where, name = _bad_string(value, key), key
                if where is not None:
                    raise InvalidRequestError(
                        f"{where[:80]} is not valid Unicode text (lone surrogates cannot be encoded as UTF-8).",
                        name,
                    )
        return data

    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    priority: int = Field(default=0, ge=-_I32, le=_I32)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}.", "n")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class CompletionRequest(_Sampling):
    # token ids must be JSON integers: floats and booleans are refused, not converted
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty.", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                kind = str(part.get("type"))[:32]
                raise InvalidRequestError(
                    f"messages: content parts of type {kind!r} are not supported.", "messages"
                )
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidRequestError(
                    "messages: a text content part's 'text' must be a string.", "messages"
                )
            parts.append(text)
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
