"""POST /v1/chat/completions, and the chat rendering /tokenize shares.

What a request asks of its output is settled before it is admitted:
- an output constraint: `response_format`, vLLM's `structured_outputs` or its older
  `guided_*` fields (at most one), validated here so that a bad schema is a 400 naming
  the field that carried it;
- tools (`tool_calls.py`): with tool_choice "none" (or no tools) the request is rendered
  and answered as if it had no tools; "auto" shows the tools to the model (the chat
  template's own `tools=` support, else tool_calls.py's tools prompt) and parses its text
  with the server's --tool-call-parser; "required" and a named function are enforced with
  a JSON schema without free whitespace (so they cannot be combined with another
  constraint, and a small model cannot fill whitespace until max_tokens) and parsed as such.

finish_reason is "tool_calls" when "auto" or "required" produced calls and the model
stopped by itself; a named function keeps "stop" (as OpenAI's API does). Streamed calls
arrive as OpenAI's deltas: a call's first delta carries its id, type and name, the next
ones fragments of its arguments, which concatenate to the non-streamed arguments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.server.admission import RequestTracker
from pagedserve.server.chat_template import render_request_template
from pagedserve.server.http_errors import to_api_error
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.responses import SSE_DONE, envelope, sse, stream_error_events, usage
from pagedserve.server.serving_base import ServingContext
from pagedserve.server.tool_calls import (
    TOOL_PARSERS,
    ToolCallStreamer,
    check_tools,
    fallback_messages,
    forced_structured_outputs,
    parse_forced,
    parse_tool_calls,
    template_supports_tools,
    template_tools,
)
from pagedserve.structured_outputs.validate import validate_structured_outputs


def _template_text(tokenizer, messages: list[dict], add_generation_prompt: bool, tools) -> str:
    """The model's own chat template (trusted; transformers renders it in Jinja's sandbox)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template.", "messages")
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
    )


@dataclass
class ToolPlan:
    """A chat request's tools: the functions, tool_choice ("none" | "auto" | "required" |
    {"name": ...}) and whether several calls may be returned."""

    functions: list[dict]
    choice: str | dict
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The tools are shown to the model and its output parsed for calls."""
        return bool(self.functions) and self.choice != "none"

    @property
    def forced(self) -> str | dict | None:
        return self.choice if self.choice == "required" or isinstance(self.choice, dict) else None


def openai_deltas(events: list[dict], parallel: bool = True) -> list[dict]:
    """ToolCallStreamer events -> chat deltas, in order: text as {"content"}, a call's
    start as {"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}, its
    argument fragments as {"tool_calls": [{index, function: {arguments}}]}."""
    out: list[dict] = []
    for e in events:
        if "content" in e:
            if not e["content"]:
                continue
            if out and "content" in out[-1]:
                out[-1]["content"] += e["content"]
            else:
                out.append({"content": e["content"]})
        elif parallel or e["index"] == 0:
            if "id" in e:
                entry = {
                    "index": e["index"],
                    "id": e["id"],
                    "type": "function",
                    "function": {"name": e["name"], "arguments": e["arguments"]},
                }
            else:
                entry = {"index": e["index"], "function": {"arguments": e["arguments"]}}
            out.append({"tool_calls": [entry]})
    return out


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext, tool_parser: str = "hermes") -> None:
        if tool_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; got {tool_parser!r}."
            )
        self.ctx = ctx
        self.tool_parser = tool_parser

    # -- the request ----------------------------------------------------------------------------
    def _params(self, body: ChatCompletionRequest):
        messages = [m.to_template() for m in body.messages]
        if not messages:
            raise InvalidRequestError("messages must not be empty.", "messages")
        size = sum(len(m["content"].encode("utf-8")) + len(m["role"].encode("utf-8")) for m in messages)
        if body.tools:
            size += len(json.dumps(body.tools).encode("utf-8"))
        self.ctx.check_text_size(size, "messages")
        self.check_template(body.chat_template)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs must be used with logprobs=true.", "top_logprobs")
        plan = self.tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls is not False)
        so = self._constraint(body, plan, self.ctx.compact_json)
        k = (body.top_logprobs or 0) if body.logprobs else None
        return messages, plan, body.sampling_params(
            body.max_new_tokens(), k, structured_outputs=so, default_slo=self.ctx.default_slo
        )

    def check_template(self, chat_template: str | None) -> None:
        if chat_template is not None and not self.ctx.trust_request_chat_template:
            raise InvalidRequestError(
                "request chat templates are disabled on this server (start it with "
                "--trust-request-chat-template to allow them).",
                "chat_template",
            )

    @staticmethod
    def tool_plan(tools, tool_choice, parallel: bool = True) -> ToolPlan:
        """Checked tools: every function's parameters must be a schema that compiles
        (cached per schema), whatever tool_choice is."""
        functions, choice = check_tools(tools, tool_choice)
        for f in functions:
            try:
                validate_structured_outputs(StructuredOutputsParams(json=f["parameters"]), "tools")
            except InvalidRequestError as e:
                raise InvalidRequestError(f"function {f['name'][:64]!r}: {e}", "tools") from None
        return ToolPlan(functions, choice, parallel)

    @staticmethod
    def _constraint(
        body: ChatCompletionRequest, plan: ToolPlan, compact_json: bool
    ) -> StructuredOutputsParams | None:
        found = body.constraints(compact_json)
        if plan.active and plan.forced is not None:
            if found:
                raise InvalidRequestError(
                    f"tool_choice {'required' if plan.forced == 'required' else 'naming a function'} is "
                    f"enforced with its own constraint and cannot be combined with {found[0][0]}.",
                    found[0][0],
                )
            # arguments are read by programs: no free whitespace (which a small model can fill
            # until max_tokens, leaving arguments that do not parse)
            so = forced_structured_outputs(plan.functions, plan.forced, plan.parallel)
            so = dataclasses.replace(so, disable_any_whitespace=True)
            validate_structured_outputs(so, "tools")
            return so
        if not found:
            return None
        param, so = found[0]
        validate_structured_outputs(so, param)
        return so

    async def render_text(
        self,
        messages: list[dict],
        functions: list[dict],
        add_generation_prompt: bool,
        chat_template: str | None,
    ) -> str:
        """The prompt text: the model's template (or the request's, when allowed) with the
        functions shown through the template's `tools` if it renders them, else through
        the tools prompt."""
        tok = self.ctx.tokenizer
        template = chat_template if chat_template is not None else getattr(tok, "chat_template", None)
        native = isinstance(template, str) and template_supports_tools(template)
        tools = template_tools(functions) if functions and native else None
        if not native:
            messages = fallback_messages(messages, functions)
        try:
            if chat_template is None:
                text = await asyncio.to_thread(_template_text, tok, messages, add_generation_prompt, tools)
            else:
                specials = {
                    name: getattr(tok, name, None)
                    for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                }
                specials = {k: v for k, v in specials.items() if isinstance(v, str)}
                text = await render_request_template(
                    chat_template, messages, add_generation_prompt, specials, tools=tools
                )
        except ValueError:
            raise
        except Exception as e:  # a template that fails to render is bad input, not a crash
            msg = str(e)[:200]
            raise InvalidRequestError(f"could not apply the chat template: {msg}", "messages") from None
        self.ctx.check_text_size(len(text.encode("utf-8")), "messages")
        return text

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        tok = self.ctx.tokenizer
        return await asyncio.to_thread(lambda: list(tok.encode(text, add_special_tokens=add_special_tokens)))

    # -- the response ---------------------------------------------------------------------------
    def _message(self, plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if not plan.active:
            return {"role": "assistant", "content": text}, finish_reason
        if plan.forced is not None:
            calls = parse_forced(text, plan.forced)
            content = None if calls else text
        else:
            content, calls = parse_tool_calls(text, self.tool_parser)
        if not plan.parallel:
            calls = calls[:1]
        msg: dict = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg, self._finish_reason(plan, bool(calls), finish_reason)

    @staticmethod
    def _finish_reason(plan: ToolPlan, called: bool, finish_reason: str | None) -> str | None:
        if called and finish_reason == "stop" and not isinstance(plan.choice, dict):
            return "tool_calls"
        return finish_reason

    async def create(self, body: ChatCompletionRequest, request: Request):
        ctx = self.ctx
        lora = ctx.check_model(body.model)
        try:
            messages, plan, params = self._params(body)
        except ValueError as e:
            raise to_api_error(e) from None
        # admitted (and counted) before templating: the bound covers requests being tokenized
        tracker = ctx.admit(1, request.scope, body.request_timeout, lora)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            try:
                shown = plan.functions if plan.active else []
                text = await self.render_text(messages, shown, body.add_generation_prompt, body.chat_template)
                ids = await self.encode(text)
            except ValueError as e:
                raise to_api_error(e) from None
            await tracker.add([{"prompt_token_ids": ids}], params, rid, body.priority, suffix=False)
            if not body.stream:
                (final,) = await tracker.finals()
        except BaseException:
            tracker.close()
            raise
        created = int(time.time())
        k = body.top_logprobs or 0
        if not body.stream:
            tracker.close()
            choices = []
            for c in sorted(final.outputs, key=lambda c: c.index):
                message, finish_reason = self._message(plan, c.text, c.finish_reason)
                choices.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": self._logprobs(body, c, k),
                        "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            ct = sum(len(c.token_ids) for c in final.outputs)
            return envelope(rid, "chat.completion", created, ctx.model_name, choices, usage(len(ids), ct))
        return StreamingResponse(
            self._stream(tracker, body, plan, rid, created, len(ids), params.n, k),
            media_type="text/event-stream",
        )

    def _logprobs(self, body, c, k: int):
        return self.ctx.logprobs.chat(c.logprobs or [], c.token_ids, k) if body.logprobs else None

    async def _stream(
        self,
        tracker: RequestTracker,
        body,
        plan: ToolPlan,
        rid: str,
        created: int,
        prompt_len: int,
        n: int,
        k: int,
    ):
        model = self.ctx.model_name
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        state = _StreamState()

        def chunk(choices, usage_=None) -> str:
            return sse(envelope(rid, "chat.completion.chunk", created, model, choices, usage_))

        try:
            try:
                while True:
                    _, out = await tracker.next()
                    if out is None:
                        break
                    for c in out.outputs:
                        for choice in self._choice_deltas(c, body, plan, state, k):
                            yield chunk([choice])
            except Exception as e:  # noqa: BLE001 (shutdown, engine failure, a bug: end this stream cleanly)
                for event in stream_error_events(e, f"chat stream {rid}"):
                    yield event
                for idx in range(n):
                    if idx not in state.finished:
                        delta = {} if idx in state.started else {"role": "assistant", "content": ""}
                        yield chunk([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": "abort"}])
            if include_usage:
                yield chunk([], usage(prompt_len, state.completion_tokens))
            yield SSE_DONE
        finally:
            tracker.close()

    def _choice_deltas(self, c, body, plan: ToolPlan, state: _StreamState, k: int) -> list[dict]:
        """The chunk choices one step's output of choice `c` makes (none while text is held
        back: a tool call's start may be coming). The first carries the role; the last the
        finish reason."""
        state.completion_tokens += len(c.token_ids)
        finish_reason = c.finish_reason
        if finish_reason is not None:
            state.finished.add(c.index)
        if plan.active:
            st = state.streamers.get(c.index)
            if st is None:
                st = state.streamers[c.index] = ToolCallStreamer(self.tool_parser, forced=plan.forced)
            events = st.feed(c.text)
            if finish_reason is not None:
                events += st.finish()
            deltas = openai_deltas(events, plan.parallel)
            finish_reason = self._finish_reason(plan, bool(st.calls), finish_reason)
        else:
            deltas = [{"content": c.text}]
        first = c.index not in state.started
        if not deltas and (first or finish_reason is not None or body.logprobs):
            deltas = [{}]
        if not deltas:
            return []
        if first:
            state.started.add(c.index)
            head = deltas[0]
            if "content" not in head and "tool_calls" not in head:
                head["content"] = ""
            deltas[0] = {"role": "assistant", **head}
        last = len(deltas) - 1
        return [
            {
                "index": c.index,
                "delta": delta,
                "logprobs": self._logprobs(body, c, k) if j == 0 else None,
                "finish_reason": finish_reason if j == last else None,
                **({"stop_reason": c.stop_reason} if j == last and finish_reason is not None else {}),
            }
            for j, delta in enumerate(deltas)
        ]


@dataclass
class _StreamState:
    """One chat stream's progress over its n choices."""

    started: set[int] = field(default_factory=set)  # choices whose first chunk (the role) is out
    finished: set[int] = field(default_factory=set)
    streamers: dict[int, ToolCallStreamer] = field(default_factory=dict)  # tool-call parsing per choice
    completion_tokens: int = 0
