"""POST /v1/messages (Anthropic's Messages API) over the chat endpoint.

`system` a system message, `messages` with text, tool_use and tool_result blocks chat
messages (tool_use blocks an assistant's tool_calls, tool_result blocks tool messages),
`tools` ({name, description, input_schema}) and `tool_choice` ({"type": "auto" | "any" |
"tool" | "none"}) chat's tools, `stop_sequences` stop strings. The result comes back as a
message (text and tool_use content blocks, stop_reason end_turn / max_tokens /
stop_sequence / tool_use) or Anthropic's event stream (message_start,
content_block_start / _delta / _stop, message_delta, message_stop). Errors on this path
use Anthropic's error shape (http_errors.py), and `x-api-key` is accepted as the key.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.errors import InvalidRequestError
from pagedserve.server.http_errors import to_api_error
from pagedserve.server.protocol import ChatCompletionRequest


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None


def _blocks_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for b in content or []:
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise InvalidRequestError(f"{where}: content blocks of type {str(b.get('type'))[:32]!r} are not supported here.", "messages")
        parts.append(b["text"])
    return "".join(parts)


def chat_messages(body: MessagesRequest) -> list[dict]:
    msgs = [{"role": "system", "content": _blocks_text(body.system, "system")}] if body.system else []
    for i, m in enumerate(body.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"messages[{i}].role must be user or assistant.", "messages")
        if isinstance(content, str):
            msgs.append({"role": role, "content": content})
            continue
        text, calls = [], []
        for b in content or []:
            kind = b.get("type")
            if kind == "text":
                text.append(b.get("text", ""))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": b.get("id"), "type": "function", "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                result = b.get("content", "")
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                             "content": result if isinstance(result, str) else _blocks_text(result, f"messages[{i}] tool_result")})
            else:
                raise InvalidRequestError(f"messages[{i}]: content blocks of type {str(kind)[:32]!r} are not supported.", "messages")
        if text or calls:
            msg: dict = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    return msgs


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom"):
            raise InvalidRequestError(f"tools[{i}]: server tools ({str(t.get('type'))[:40]}) are not supported.", "tools")
        out.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                      "parameters": t.get("input_schema", {"type": "object"})}})
    return out


def chat_tool_choice(choice: dict | None):
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise InvalidRequestError("tool_choice.type must be auto, any, tool or none.", "tool_choice")
    return mapped


def stop_reason(finish_reason: str | None, stop: Any, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str) and stop in (stop_sequences or []):
        return "stop_sequence", stop
    return "end_turn", None


def content_blocks(message: dict) -> list[dict]:
    blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        f = call["function"]
        try:
            args = json.loads(f["arguments"]) if f["arguments"] else {}
        except ValueError:
            args = {"_raw": f["arguments"]}
        blocks.append({"type": "tool_use", "id": call["id"], "name": f["name"], "input": args})
    return blocks


class AnthropicServingMessages:
    def __init__(self, ctx, chat) -> None:
        self.ctx, self.chat = ctx, chat

    async def create(self, body: MessagesRequest, request: Request):
        self.ctx.check_model(body.model)
        try:
            if body.thinking and body.thinking.get("type") not in (None, "disabled"):
                raise InvalidRequestError("thinking is not supported by this server.", "thinking")
            chat_body = self._chat_body(body)
        except ValueError as e:
            raise to_api_error(e) from None
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        out = await self.chat.create(chat_body, request)
        if body.stream:
            return StreamingResponse(self._stream(out.body_iterator, body, mid), media_type="text/event-stream")
        choice = out["choices"][0]
        reason, seq = stop_reason(choice["finish_reason"], choice.get("stop_reason"), body.stop_sequences)
        u = out["usage"]
        return {"id": mid, "type": "message", "role": "assistant", "model": self.ctx.model_name,
                "content": content_blocks(choice["message"]), "stop_reason": reason, "stop_sequence": seq,
                "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}}

    def _chat_body(self, body: MessagesRequest) -> ChatCompletionRequest:
        choice = body.tool_choice or {}
        fields = {
            "model": body.model, "messages": chat_messages(body), "max_tokens": body.max_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences,
            "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
            "parallel_tool_calls": False if choice.get("disable_parallel_tool_use") else None,
            "stream": body.stream, "stream_options": {"include_usage": True} if body.stream else None,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            raise InvalidRequestError(f"messages: {first.get('msg', 'invalid value')}"[:300], "messages") from None

    async def _stream(self, chunks, body: MessagesRequest, mid: str):
        def event(kind: str, **fields) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

        message = {"id": mid, "type": "message", "role": "assistant", "model": self.ctx.model_name, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        blocks: list[str] = []  # open block kinds, by index
        calls: dict[int, int] = {}  # chat tool-call index -> block index
        finish, stop, usage = None, None, {"prompt_tokens": 0, "completion_tokens": 0}
        try:
            yield event("message_start", message=message)
            async for raw in chunks:
                for line in raw.splitlines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        yield event("error", error={"type": "api_error", "message": chunk["error"].get("message", "")})
                        return
                    usage = chunk.get("usage") or usage
                    for c in chunk.get("choices") or []:
                        delta = c.get("delta") or {}
                        if delta.get("content"):
                            if not blocks or blocks[-1] != "text":
                                blocks.append("text")
                                yield event("content_block_start", index=len(blocks) - 1, content_block={"type": "text", "text": ""})
                            yield event("content_block_delta", index=len(blocks) - 1, delta={"type": "text_delta", "text": delta["content"]})
                        for tc in delta.get("tool_calls") or []:
                            f = tc.get("function") or {}
                            if tc["index"] not in calls:
                                blocks.append("tool_use")
                                calls[tc["index"]] = len(blocks) - 1
                                block = {"type": "tool_use", "id": tc.get("id") or f"toolu_{uuid.uuid4().hex[:20]}", "name": f.get("name", ""), "input": {}}
                                yield event("content_block_start", index=calls[tc["index"]], content_block=block)
                            if f.get("arguments"):
                                yield event("content_block_delta", index=calls[tc["index"]], delta={"type": "input_json_delta", "partial_json": f["arguments"]})
                        finish = c.get("finish_reason") or finish
                        stop = c.get("stop_reason", stop)
            for i in range(len(blocks)):
                yield event("content_block_stop", index=i)
            reason, seq = stop_reason(finish, stop, body.stop_sequences)
            yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                        usage={"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]})
            yield event("message_stop")
        finally:
            await chunks.aclose()
