"""POST /v1/completions (with response_format / structured_outputs / guided_* constraints,
validated before admission as in serving_chat.py)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import RequestOutput
from pagedserve.server.admission import RequestTracker
from pagedserve.server.http_errors import to_api_error
from pagedserve.server.protocol import CompletionRequest
from pagedserve.server.responses import SSE_DONE, envelope, sse, stream_error_events, usage
from pagedserve.server.serving_base import ServingContext
from pagedserve.structured_outputs.validate import validate_structured_outputs


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _params(self, body: CompletionRequest):
        prompts = body.prompts()
        for p in prompts:
            if isinstance(p, str):
                self.ctx.check_text_size(len(p.encode("utf-8")), "prompt")
        max_tokens, logprobs = body.max_tokens, body.logprobs
        if max_tokens == 0 and not body.echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo=true).", "max_tokens")
        prompt_lp = None
        if body.echo and logprobs is not None:
            prompt_lp = logprobs  # the echoed prompt tokens get logprobs too
        elif max_tokens == 0:
            prompt_lp = body.prompt_logprobs or 0
        if body.suffix:
            raise InvalidRequestError("suffix (insertion) is not supported.", "suffix")
        so = None
        for param, so in body.constraints(self.ctx.compact_json):  # at most one
            validate_structured_outputs(so, param)
        return prompts, body.sampling_params(
            max_tokens, logprobs, prompt_lp, structured_outputs=so, default_slo=self.ctx.default_slo
        )

    async def create(self, body: CompletionRequest, request: Request):
        ctx = self.ctx
        lora = ctx.check_model(body.model)
        try:
            prompts, params = self._params(body)
        except ValueError as e:
            raise to_api_error(e) from None
        tracker = ctx.admit(len(prompts), request.scope, body.request_timeout, lora)
        base = f"cmpl-{uuid.uuid4().hex}"
        engine_prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        try:
            await tracker.add(engine_prompts, params, base, body.priority, suffix=True)
            if not body.stream:
                finals = await tracker.finals()
        except BaseException:
            tracker.close()
            raise
        created = int(time.time())
        if not body.stream:
            tracker.close()
            return self._response(body, base, created, finals, params.n)
        return StreamingResponse(
            self._stream(tracker, body, base, created, len(prompts), params.n), media_type="text/event-stream"
        )

    # -- formatting --------------------------------------------------------------------------------
    def _echo_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.ctx.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(self, body: CompletionRequest, out: RequestOutput, c, with_prompt: bool):
        if body.logprobs is None:
            return None
        entries, ids = [], []
        if with_prompt:
            entries += list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
            ids += out.prompt_token_ids
        entries += list(c.logprobs or [])
        ids += c.token_ids
        return self.ctx.logprobs.completion(entries, ids, body.logprobs)

    def _choice(self, body, out: RequestOutput, c, index: int, with_prompt: bool) -> dict:
        return {
            "index": index,
            "text": (self._echo_text(out) if with_prompt else "") + c.text,
            "logprobs": self._logprobs(body, out, c, with_prompt),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def _response(self, body, base: str, created: int, finals: list[RequestOutput], n: int) -> dict:
        choices, completion_tokens = [], 0
        for i, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                choices.append(self._choice(body, out, c, i * n + c.index, body.echo))
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        return envelope(
            base,
            "text_completion",
            created,
            self.ctx.model_name,
            choices,
            usage(prompt_tokens, completion_tokens),
        )

    async def _stream(self, tracker: RequestTracker, body, base: str, created: int, num_prompts: int, n: int):
        model = self.ctx.model_name
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echoed: set[int] = set()
        finished: set[int] = set()
        prompt_tokens = completion_tokens = 0
        live = num_prompts
        try:
            try:
                while live:
                    i, out = await tracker.next()
                    if out is None:
                        live -= 1
                        continue
                    for c in out.outputs:
                        idx = i * n + c.index
                        with_prompt = body.echo and idx not in echoed
                        if with_prompt:
                            echoed.add(idx)
                        completion_tokens += len(c.token_ids)
                        if c.finish_reason is not None:
                            finished.add(idx)
                        choice = self._choice(body, out, c, idx, with_prompt)
                        yield sse(envelope(base, "text_completion", created, model, [choice]))
                    if out.finished:
                        prompt_tokens += len(out.prompt_token_ids)
            except Exception as e:  # noqa: BLE001 (shutdown, engine failure, a bug: end this stream cleanly)
                for event in stream_error_events(e, f"completion stream {base}"):
                    yield event
                for idx in range(num_prompts * n):
                    if idx not in finished:
                        choice = {
                            "index": idx,
                            "text": "",
                            "logprobs": None,
                            "finish_reason": "abort",
                            "stop_reason": None,
                        }
                        yield sse(envelope(base, "text_completion", created, model, [choice]))
            if include_usage:
                yield sse(
                    envelope(
                        base, "text_completion", created, model, [], usage(prompt_tokens, completion_tokens)
                    )
                )
            yield SSE_DONE
        finally:
            tracker.close()
