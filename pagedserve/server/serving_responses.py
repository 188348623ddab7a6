"""POST /v1/responses (OpenAI's Responses API) over the chat endpoint, and GET / DELETE
/v1/responses/{id} over the response store (response_store.py).

A request becomes a chat completion: `instructions` a system message, `input` (a string,
or message / function_call / function_call_output items) chat messages after the stored
conversation of `previous_response_id`, function `tools` and `tool_choice` in chat's
shape, `text.format` a response_format (json_schema through the structured-outputs
engine). The chat result (or stream) is turned back into a response object (or the
Responses event stream: response.created, response.output_item.added,
response.output_text.delta, response.function_call_arguments.delta, ...,
response.completed). Built-in tools (web search, file search, ...) and other fields this
server cannot honour are a 400 naming them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.errors import InvalidRequestError
from pagedserve.server.http_errors import APIError, to_api_error
from pagedserve.server.protocol import ChatCompletionRequest

UNSUPPORTED_FIELDS = ("reasoning", "background", "conversation", "prompt", "include")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check_fields(self) -> None:
        for name in UNSUPPORTED_FIELDS:
            if (self.model_extra or {}).get(name) not in (None, [], {}):
                raise InvalidRequestError(f"{name} is not supported by this server.", name)
        unknown = sorted(set(self.model_extra or {}) - set(UNSUPPORTED_FIELDS))
        if unknown:
            raise InvalidRequestError(f"unknown field(s): {', '.join(unknown)[:200]}.", unknown[0])
        if self.truncation not in (None, "disabled"):
            raise InvalidRequestError("truncation must be 'disabled' (the prompt is never cut).", "truncation")


# -- request: Responses -> chat ------------------------------------------------------------------
def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}: content must be a string or a list of parts.", "input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}: content parts of type {str(kind)[:32]!r} are not supported.", "input")
        out.append(part["text"])
    return "".join(out)


def chat_messages(items: str | list[dict]) -> list[dict]:
    """Responses input items as chat messages (consecutive function calls form one
    assistant message, as chat templates expect)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict] = []
    for i, it in enumerate(items):
        kind = it.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(it.get("role"), it.get("role"))
            if role not in ("system", "user", "assistant"):
                raise InvalidRequestError(f"input[{i}].role must be user, assistant, system or developer.", "input")
            msgs.append({"role": role, "content": _text_of(it.get("content", ""), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function", "function": {"name": it.get("name"), "arguments": it.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": out if isinstance(out, str) else json.dumps(out)})
        else:
            raise InvalidRequestError(f"input[{i}]: items of type {str(kind)[:32]!r} are not supported.", "input")
    return msgs


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise InvalidRequestError(
                f"tools[{i}]: tools of type {str(t.get('type'))[:40]!r} (built-in tools) are not supported; only function tools.",
                "tools",
            )
        f = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": f})
    return out


def chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequestError("tool_choice must be auto, none, required or a function.", "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequestError(f"text.format type {str(fmt.get('type'))[:32]!r} is not supported.", "text")


# -- response: chat -> Responses -------------------------------------------------------------------
def output_items(message: dict) -> list[dict]:
    items = []
    if message.get("content"):
        items.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        f = call["function"]
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                      "name": f["name"], "arguments": f["arguments"], "status": "completed"})
    return items


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex[:24]}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def usage_of(chat_usage: dict | None) -> dict | None:
    if not chat_usage:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def assistant_message(items: list[dict]) -> dict:
    """The response's output as one chat message, for the stored conversation."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg


class OpenAIServingResponses:
    def __init__(self, ctx, chat, store) -> None:
        self.ctx, self.chat, self.store = ctx, chat, store

    async def create(self, body: ResponsesRequest, request: Request):
        ctx = self.ctx
        ctx.check_model(body.model)
        try:
            body.check_fields()
            history = await self._history(body.previous_response_id)
            new = chat_messages(body.input)
            chat_body = self._chat_body(body, ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history + new)
        except ValueError as e:
            raise to_api_error(e) from None
        rid = f"resp_{uuid.uuid4().hex}"
        created = int(time.time())
        out = await self.chat.create(chat_body, request)
        if body.stream:
            return StreamingResponse(self._stream(out.body_iterator, body, rid, created, history + new), media_type="text/event-stream")
        choice = out["choices"][0]
        items = output_items(choice["message"])
        status, incomplete = ("incomplete", {"reason": "max_output_tokens"}) if choice["finish_reason"] == "length" else ("completed", None)
        response = self._response(body, rid, created, items, usage_of(out.get("usage")), status, incomplete)
        await self._save(body, response, history + new + [assistant_message(items)])
        return response

    def _chat_body(self, body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
        fields = {
            "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": chat_tools(body.tools),
            "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": response_format(body.text), "stream": body.stream,
        }
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise InvalidRequestError(f"{where or 'input'}: {first.get('msg', 'invalid value')}"[:300], "input") from None

    async def _history(self, previous_id: str | None) -> list[dict]:
        if previous_id is None:
            return []
        found = await asyncio.to_thread(self.store.get, previous_id) if self.store is not None else None
        if found is None:
            raise InvalidRequestError(f"previous response {previous_id[:64]!r} not found.", "previous_response_id")
        return found[1]

    async def _save(self, body: ResponsesRequest, response: dict, conversation: list[dict]) -> None:
        if body.store and self.store is not None:
            await asyncio.to_thread(self.store.put, response, conversation)

    def _response(self, body, rid, created, items, usage, status, incomplete=None, error=None) -> dict:
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "model": self.ctx.model_name,
            "output": items, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "previous_response_id": body.previous_response_id, "store": body.store, "metadata": body.metadata or {},
            "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
            "incomplete_details": incomplete, "error": error,
        }

    async def _stream(self, chunks, body, rid: str, created: int, conversation: list[dict]):
        ev = _EventStream(self, body, rid, created)
        try:
            yield ev.event("response.created", response=ev.snapshot("in_progress"))
            yield ev.event("response.in_progress", response=ev.snapshot("in_progress"))
            async for raw in chunks:
                for line in raw.splitlines():
                    if line.startswith("data: {"):
                        for e in ev.on_chunk(json.loads(line[6:])):
                            yield e
            for e in ev.finish():
                yield e
            if ev.error is None:
                await self._save(body, ev.final, conversation + [assistant_message(ev.final["output"])])
        finally:
            await chunks.aclose()

    async def retrieve(self, response_id: str) -> dict:
        found = await asyncio.to_thread(self.store.get, response_id) if self.store is not None else None
        if found is None:
            raise APIError(404, f"response {response_id[:64]!r} not found", "invalid_request_error", "response_id", "not_found")
        return found[0]

    async def delete(self, response_id: str) -> dict:
        gone = await asyncio.to_thread(self.store.delete, response_id) if self.store is not None else False
        if not gone:
            raise APIError(404, f"response {response_id[:64]!r} not found", "invalid_request_error", "response_id", "not_found")
        return {"id": response_id, "object": "response", "deleted": True}


class _EventStream:
    """Chat stream chunks in, Responses events out (each with its sequence number)."""

    def __init__(self, serving: OpenAIServingResponses, body, rid: str, created: int) -> None:
        self.serving, self.body, self.rid, self.created = serving, body, rid, created
        self.seq = 0
        self.items: list[dict] = []  # output items so far, in order
        self.text_item: dict | None = None  # the open message item
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its open function_call item
        self.usage = self.error = self.final = None
        self.finish_reason = None

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **fields})}\n\n"

    def snapshot(self, status: str, incomplete=None) -> dict:
        return self.serving._response(self.body, self.rid, self.created, self.items, usage_of(self.usage), status, incomplete, self.error)

    def on_chunk(self, chunk: dict) -> list[str]:
        if "error" in chunk:
            self.error = {"code": chunk["error"].get("code") or "server_error", "message": chunk["error"].get("message", "")}
            return [self.event("error", code=self.error["code"], message=self.error["message"], param=None)]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for tc in delta.get("tool_calls") or []:
                out += self._call(tc)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _text(self, piece: str) -> list[str]:
        out = []
        if self.text_item is None:
            self.text_item = _message_item("", "in_progress")
            self.items.append(self.text_item)
            i = len(self.items) - 1
            out.append(self.event("response.output_item.added", output_index=i, item={**self.text_item, "content": []}))
            out.append(self.event("response.content_part.added", item_id=self.text_item["id"], output_index=i, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        self.text_item["content"][0]["text"] += piece
        out.append(self.event("response.output_text.delta", item_id=self.text_item["id"], output_index=self.items.index(self.text_item),
                              content_index=0, delta=piece, logprobs=[]))
        return out

    def _call(self, tc: dict) -> list[str]:
        out, f = [], tc.get("function") or {}
        item = self.calls.get(tc["index"])
        if item is None:
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": tc.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                    "name": f.get("name", ""), "arguments": "", "status": "in_progress"}
            self.calls[tc["index"]] = item
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if f.get("arguments"):
            item["arguments"] += f["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=f["arguments"]))
        return out

    def finish(self) -> list[str]:
        out = []
        for i, item in enumerate(self.items):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                      text=part["text"], logprobs=[]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                      arguments=item["arguments"], name=item["name"]))
            out.append(self.event("response.output_item.done", output_index=i, item=item))
        if self.error is not None:
            self.final = self.snapshot("failed")
            return out + [self.event("response.failed", response=self.final)]
        if self.finish_reason == "length":
            self.final = self.snapshot("incomplete", {"reason": "max_output_tokens"})
            return out + [self.event("response.incomplete", response=self.final)]
        self.final = self.snapshot("completed")
        return out + [self.event("response.completed", response=self.final)]
