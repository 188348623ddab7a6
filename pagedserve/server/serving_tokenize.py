"""POST /tokenize and /detokenize, in vLLM's shapes.

/tokenize takes a `prompt` (special tokens added by default, as a completion's prompt is
encoded) or chat `messages` (rendered exactly as /v1/chat/completions renders them, tools
included; no special tokens added by default) and answers
{count, max_model_len, tokens, token_strs}; /detokenize takes {tokens} and answers
{prompt}. Neither touches the engine; token ids outside the vocabulary are a 400.
"""

from __future__ import annotations

import asyncio

from pagedserve.errors import InvalidRequestError
from pagedserve.server.http_errors import to_api_error
from pagedserve.server.protocol import DetokenizeRequest, TokenizeRequest
from pagedserve.server.serving_base import ServingContext
from pagedserve.server.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    def __init__(self, ctx: ServingContext, chat: OpenAIServingChat) -> None:
        self.ctx = ctx
        self.chat = chat
        model_config = getattr(ctx.llm, "model_config", None)
        self.vocab_size = getattr(model_config, "vocab_size", None) or len(ctx.tokenizer)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.ctx.check_model(body.model)
        try:
            ids = await self._ids(body)
        except ValueError as e:
            raise to_api_error(e) from None
        tok = self.ctx.tokenizer
        return {
            "count": len(ids),
            "max_model_len": self.ctx.max_model_len,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        }

    async def _ids(self, body: TokenizeRequest) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give either prompt or messages.", "prompt")
        if body.prompt is not None:
            self.ctx.check_text_size(len(body.prompt.encode("utf-8")), "prompt")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            return await self.chat.encode(body.prompt, add)
        messages = [m.to_template() for m in body.messages]
        if not messages:
            raise InvalidRequestError("messages must not be empty.", "messages")
        self.ctx.check_text_size(sum(len(m["content"].encode("utf-8")) for m in messages), "messages")
        self.chat.check_template(body.chat_template)
        plan = self.chat.tool_plan(body.tools, None)
        shown = plan.functions if plan.active else []
        text = await self.chat.render_text(messages, shown, body.add_generation_prompt, body.chat_template)
        return await self.chat.encode(text, bool(body.add_special_tokens))

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.ctx.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise to_api_error(
                InvalidRequestError(f"token ids must be in [0, {self.vocab_size}), got {bad}.", "tokens")
            )
        tok = self.ctx.tokenizer
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}
