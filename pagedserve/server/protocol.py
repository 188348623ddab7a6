"""OpenAI request bodies (with vLLM's extra sampling fields) and their mapping to SamplingParams.

Bodies are strict: a field no model here declares is a 400 naming it (param = the first),
so nothing a client asks for is silently dropped. The exceptions are IGNORED_FIELDS
(OpenAI's platform bookkeeping, declared and unused) and unknown fields set to null. Output
constraints come from response_format, structured_outputs or guided_* (one per request,
`_Sampling.constraints`); tools are checked in tool_calls.py.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SLO, RequestOutputKind, SamplingParams, StructuredOutputsParams

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
    model_config = ConfigDict(extra="forbid")  # e.g. vLLM's continuous_usage_stats: a 400

    include_usage: bool = False


# OpenAI fields that are accepted and ignored: they ask nothing of the output (bookkeeping
# for OpenAI's own platform). Every other field the models below do not declare is a 400
# naming it, so a client never believes it asked for something that was dropped.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
MAX_NAMED = 8  # an error names at most this many unknown fields


def _field_name(key) -> str:
    s = key if isinstance(key, str) else repr(key)
    return s[:64].encode("utf-8", "backslashreplace").decode("utf-8")


class _Request(BaseModel):
    """A request body: strings must be valid Unicode, and fields must be known (declared
    here or in IGNORED_FIELDS). An unknown field set to null asks for nothing and is dropped."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data):
        if not isinstance(data, dict):
            return data
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
        known = cls.model_fields
        unknown = [k for k, v in data.items() if k not in known and v is not None]
        if unknown:
            names = ", ".join(repr(_field_name(k)) for k in unknown[:MAX_NAMED])
            more = f" and {len(unknown) - MAX_NAMED} more" if len(unknown) > MAX_NAMED else ""
            raise InvalidRequestError(
                f"unsupported field{'s' if len(unknown) > 1 else ''} {names}{more} (this server refuses "
                "the fields it does not implement rather than ignoring them).",
                _field_name(unknown[0]),
            )
        return {k: v for k, v in data.items() if k in known}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # OpenAI's strict mode: the output always follows the schema here


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self, compact: bool = False) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError(
                "response_format of type json_schema needs json_schema.schema.", "response_format"
            )
        schema = self.json_schema.schema_
        if schema is True or schema == {}:  # any JSON value: OpenAI's clients mean an object
            return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
        if schema is False:
            raise InvalidRequestError(
                "response_format: the schema false admits no output.", "response_format"
            )
        return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)


# vLLM's structured_outputs extra body: the constraint (one of) and its JSON options
_SO_FIELDS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "disable_any_whitespace",
    "disable_additional_properties",
)
# vLLM's older names (before structured_outputs): guided_json=... is structured_outputs.json
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _structured_outputs_from_body(value: dict, compact: bool) -> StructuredOutputsParams:
    extra = [k for k in value if k not in _SO_FIELDS]
    if extra:
        names = ", ".join(repr(_field_name(k)) for k in extra[:MAX_NAMED])
        raise InvalidRequestError(
            f"structured_outputs: unsupported key(s) {names} (supported: {', '.join(_SO_FIELDS)}).",
            "structured_outputs",
        )
    for k in ("disable_any_whitespace", "disable_additional_properties"):
        if not isinstance(value.get(k, False), bool):
            raise InvalidRequestError(f"structured_outputs.{k} must be a boolean.", "structured_outputs")
    return StructuredOutputsParams(**{"disable_any_whitespace": compact, **value})


class _Sampling(_Request):
    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
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
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # pagedserve's extra: latency targets ({"ttft_ms": ..., "tpot_ms": ..., "name": ...})
    slo: dict[str, Any] | None = None
    # pagedserve's extra: abort the request after this many seconds (504; --request-timeout caps it)
    request_timeout: float | None = Field(default=None, gt=0, le=1e7)

    def constraints(self, compact_json: bool = False) -> list[tuple[str, StructuredOutputsParams]]:
        """The output constraints this request asks for, each with the field that asked:
        response_format, structured_outputs and vLLM's guided_* names (at most one may).
        `compact_json` (the server's --structured-outputs-disable-any-whitespace): JSON
        without free whitespace, unless structured_outputs says otherwise."""
        found = []
        if self.response_format is not None:
            so = self.response_format.structured_outputs(compact_json)
            if so is not None:
                found.append(("response_format", so))
        if self.structured_outputs is not None:
            found.append(
                ("structured_outputs", _structured_outputs_from_body(self.structured_outputs, compact_json))
            )
        for name, kind in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                ws = {"disable_any_whitespace": compact_json} if kind == "json" else {}
                found.append((name, StructuredOutputsParams(**{kind: value}, **ws)))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise InvalidRequestError(f"only one output constraint per request; got {names}.", found[1][0])
        return found

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
        default_slo: SLO | None = None,
    ) -> SamplingParams:
        """`default_slo`: the server's (--default-slo), for requests that bring none."""
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
            structured_outputs=structured_outputs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            slo=default_slo if self.slo is None else self.slo,
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
    """One chat message; besides role and content, an assistant's `tool_calls` and a tool
    result's `tool_call_id` / `name` reach the chat template (other keys are dropped)."""

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

    def to_template(self) -> dict:
        """The message as chat templates read it: tool-call arguments as objects (the
        templates of Qwen, Llama 3, Hermes... write them with `tojson`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        extra = self.model_extra or {}
        for key in ("tool_call_id", "name"):
            if extra.get(key) is not None:
                if not isinstance(extra[key], str):
                    raise InvalidRequestError(f"messages: {key} must be a string.", "messages")
                out[key] = extra[key]
        calls = extra.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise InvalidRequestError("messages: tool_calls must be a list.", "messages")
            out["tool_calls"] = [_template_call(c) for c in calls]
        return out


def _template_call(call) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise InvalidRequestError(
            "messages: each tool call must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}.",
            "messages",
        )
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # else left as the model wrote it
            args = json.loads(args) if args.strip() else {}
    out = {"type": "function", "function": {"name": f["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the first)
    add_generation_prompt: bool = True
    chat_template: str | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]
