"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.errors import InvalidRequestError
from pagedserve.server.chat_template import render_request_template
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.serving_base import (
    SSE_DONE,
    APIError,
    RequestTracker,
    ServingContext,
    envelope,
    sse,
    to_api_error,
    usage,
)

logger = logging.getLogger(__name__)


def _template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The model's own chat template (trusted; transformers renders it in Jinja's sandbox)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template.", "messages")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _params(self, body: ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if not messages:
            raise InvalidRequestError("messages must not be empty.", "messages")
        size = sum(len(m["content"].encode("utf-8")) + len(m["role"].encode("utf-8")) for m in messages)
        self.ctx.check_text_size(size, "messages")
        if body.chat_template is not None and not self.ctx.trust_request_chat_template:
            raise InvalidRequestError(
                "request chat templates are disabled on this server (start it with "
                "--trust-request-chat-template to allow them).",
                "chat_template",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs must be used with logprobs=true.", "top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        return messages, body.sampling_params(body.max_new_tokens(), k)

    async def _render(self, body: ChatCompletionRequest, messages: list[dict]) -> list[int]:
        tok = self.ctx.tokenizer
        try:
            if body.chat_template is None:
                return await asyncio.to_thread(_template_ids, tok, messages, body.add_generation_prompt)
            specials = {
                name: getattr(tok, name, None)
                for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            }
            specials = {k: v for k, v in specials.items() if isinstance(v, str)}
            text = await render_request_template(
                body.chat_template, messages, body.add_generation_prompt, specials
            )
            self.ctx.check_text_size(len(text.encode("utf-8")), "messages")
            return await asyncio.to_thread(lambda: list(tok.encode(text, add_special_tokens=False)))
        except ValueError:
            raise
        except Exception as e:  # a template that fails to render is bad input, not a crash
            msg = str(e)[:200]
            raise InvalidRequestError(f"could not apply the chat template: {msg}", "messages") from None

    async def create(self, body: ChatCompletionRequest, request: Request):
        ctx = self.ctx
        ctx.check_model(body.model)
        try:
            messages, params = self._params(body)
        except ValueError as e:
            raise to_api_error(e) from None
        # admitted (and counted) before templating: the bound covers requests being tokenized
        tracker = ctx.admit(1, request.scope)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            try:
                ids = await self._render(body, messages)
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
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(body, c, k),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in sorted(final.outputs, key=lambda c: c.index)
            ]
            ct = sum(len(c.token_ids) for c in final.outputs)
            return envelope(rid, "chat.completion", created, ctx.model_name, choices, usage(len(ids), ct))
        return StreamingResponse(
            self._stream(tracker, body, rid, created, len(ids), params.n, k), media_type="text/event-stream"
        )

    def _logprobs(self, body, c, k: int):
        return self.ctx.logprobs.chat(c.logprobs or [], c.token_ids, k) if body.logprobs else None

    async def _stream(
        self, tracker: RequestTracker, body, rid: str, created: int, prompt_len: int, n: int, k: int
    ):
        model = self.ctx.model_name
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        started: set[int] = set()
        finished: set[int] = set()
        ct = 0

        def chunk(choices, usage_=None) -> str:
            return sse(envelope(rid, "chat.completion.chunk", created, model, choices, usage_))

        try:
            try:
                while True:
                    _, out = await tracker.next()
                    if out is None:
                        break
                    for c in out.outputs:
                        delta = {"content": c.text}
                        if c.index not in started:
                            started.add(c.index)
                            delta = {"role": "assistant", "content": c.text}
                        ct += len(c.token_ids)
                        if c.finish_reason is not None:
                            finished.add(c.index)
                        choice = {
                            "index": c.index,
                            "delta": delta,
                            "logprobs": self._logprobs(body, c, k),
                            "finish_reason": c.finish_reason,
                        }
                        yield chunk([choice])
            except Exception as e:  # noqa: BLE001 (shutdown, engine failure, a bug: end this stream cleanly)
                err = to_api_error(e)
                if err.status >= 500 and not isinstance(e, APIError):
                    logger.exception("chat stream %s failed", rid)
                if err.code != "shutting_down":
                    yield sse(err.body())
                for idx in range(n):
                    if idx not in finished:
                        delta = {} if idx in started else {"role": "assistant", "content": ""}
                        yield chunk(
                            [{"index": idx, "delta": delta, "logprobs": None, "finish_reason": "abort"}]
                        )
            if include_usage:
                yield chunk([], usage(prompt_len, ct))
            yield SSE_DONE
        finally:
            tracker.close()
