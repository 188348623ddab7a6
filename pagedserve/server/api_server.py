"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncLLM.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health,
/metrics. Errors use OpenAI's body {"error": {message, type, param, code}}: 400 for
invalid input (never a 500), 401 for a bad key, 404 for an unknown model, 413 for an
oversized body, 503 when the waiting queue is over --max-queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_engine import AsyncLLM, EngineDeadError
from pagedserve.engine.messages import PositionLogprobs
from pagedserve.frontend.tokenizer import apply_chat_template
from pagedserve.outputs import RequestOutput
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest, error_body

logger = logging.getLogger(__name__)

_PARAM = re.compile(r"^([a-z_]+) must\b")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        self.status, self.message, self.type, self.param = status, message, type_, param


def _bad_request(e: ValueError) -> APIError:
    msg = str(e)
    m = _PARAM.match(msg)
    return APIError(400, msg, param=m.group(1) if m else None)


def build_app(
    llm: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = 16 << 20,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        llm.shutdown()  # SIGTERM/SIGINT: uvicorn stops accepting and drains; abort the rest

    app = FastAPI(title="pagedserve", version="0.1.0", lifespan=lifespan)
    metrics = ServerMetrics(lambda: llm.stats, model_name)
    llm.on_finished = metrics.observe_finished
    engine = llm.engine
    tokenizer = engine.tokenizer
    served = {model_name, engine.config.model.model}

    # -- errors -----------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.status), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            msg = "request body is not valid JSON"
        else:
            msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(msg, "invalid_request_error", param, 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind, None, e.status_code), status_code=e.status_code)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if api_key and path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse(
                error_body("invalid or missing API key", "authentication_error", None, 401), 401
            )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return JSONResponse(
                error_body(
                    f"request body is larger than {max_body_bytes} bytes", "invalid_request_error", None, 413
                ),
                413,
            )
        return await call_next(request)

    # -- plain endpoints --------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not llm.is_alive:
            return JSONResponse(error_body("engine is not running", "server_error", None, 503), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pagedserve",
                    "max_model_len": engine.config.scheduler.max_model_len,
                }
            ],
        }

    # -- helpers ----------------------------------------------------------------------
    def check_admission(model: str | None) -> None:
        if model is not None and model not in served:
            raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model")
        if not llm.is_alive:
            raise APIError(503, "engine is not running", "server_error")
        if max_queue is not None and llm.stats.num_waiting >= max_queue:
            raise APIError(
                503, f"server is overloaded: {llm.stats.num_waiting} requests waiting", "server_overloaded"
            )

    async def start(prompt, params, rid: str, priority: int):
        """Queue a request; validation errors become a 400 before any response begins."""
        try:
            return await llm.add_request(prompt, params, rid, priority)
        except ValueError as e:
            raise _bad_request(e) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error") from None

    async def until_finished(streams, request: Request) -> list[RequestOutput]:
        """Drain non-streaming requests; abort them if the client goes away."""

        async def drain(stream):
            last = None
            async for out in stream:
                last = out
            if last is None or not last.finished:
                raise APIError(503, "request was aborted", "server_error")
            return last

        task = asyncio.gather(*(drain(s) for s in streams))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    raise asyncio.CancelledError
        finally:
            for s in streams:
                s.close()

    def decode_lp(d: PositionLogprobs, tid: int) -> tuple[str, float]:
        lp = d[tid]
        return (lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])), lp.logprob

    def completion_logprobs(entries, token_ids, k: int, offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = offset
        for d, tid in zip(entries, token_ids):
            if d is None:
                tok, lp, top = tokenizer.decode([tid]), None, None
            else:
                tok, lp = decode_lp(d, tid)
                top = {}
                ranked = sorted((t for t in d if d[t].rank is not None), key=lambda t: d[t].rank)
                for t in ranked[:k]:
                    s, v = decode_lp(d, t)
                    if s in top:  # two tokens with the same text (e.g. partial bytes): name them apart
                        s = tokenizer.convert_ids_to_tokens(t) or ""
                        if s in top or not s:
                            s = f"<|token_id:{t}|>"
                    top[s] = v
            out["tokens"].append(tok)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(pos)
            pos += len(tok)
        return out

    def chat_logprobs(entries, token_ids, k: int) -> dict:
        content = []
        for d, tid in zip(entries, token_ids):
            tok, lp = decode_lp(d, tid)
            tops = []
            for t in sorted((t for t in d if d[t].rank is not None), key=lambda t: d[t].rank)[:k]:
                s, v = decode_lp(d, t)
                tops.append({"token": s, "logprob": v, "bytes": list(s.encode())})
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": tops})
        return {"content": content}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # -- /v1/completions ----------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_admission(body.model)
        try:
            prompts = body.prompts()
            max_tokens, logprobs = body.max_tokens, body.logprobs
            if max_tokens == 0 and not body.echo:
                raise ValueError("max_tokens must be >= 1 (0 only with echo=true).")
            prompt_lp = None
            if body.echo and logprobs is not None:
                prompt_lp = logprobs  # the echoed prompt tokens get logprobs too
            elif max_tokens == 0:
                prompt_lp = body.prompt_logprobs or 0
            params = body.sampling_params(max_tokens, logprobs, prompt_lp)
        except ValueError as e:
            raise _bad_request(e) from None
        base = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = []
        try:
            for i, p in enumerate(prompts):
                prompt = {"prompt_token_ids": p} if isinstance(p, list) else p
                streams.append(await start(prompt, params, f"{base}-{i}", body.priority))
        except BaseException:
            for st in streams:
                st.close()
            raise
        n = params.n

        def echo_text(first: RequestOutput) -> str:
            return first.prompt if first.prompt is not None else tokenizer.decode(first.prompt_token_ids)

        def choice_logprobs(out: RequestOutput, c, with_prompt: bool):
            if logprobs is None:
                return None
            entries, ids, offset = [], [], 0
            if with_prompt:
                entries += list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
                ids += out.prompt_token_ids
            entries += list(c.logprobs or [])
            ids += c.token_ids
            return completion_logprobs(entries, ids, logprobs, offset)

        if not body.stream:
            finals = await until_finished(streams, request)
            choices, completion_tokens = [], 0
            for i, out in enumerate(finals):
                for c in sorted(out.outputs, key=lambda c: c.index):
                    text = (echo_text(out) if body.echo else "") + c.text
                    completion_tokens += len(c.token_ids)
                    choices.append(
                        {
                            "index": i * n + c.index,
                            "text": text,
                            "logprobs": choice_logprobs(out, c, body.echo),
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    )
            prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
            return {
                "id": base,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, st):
                try:
                    async for out in st:
                        await queue.put((i, out))
                finally:
                    await queue.put((i, None))

            tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
            live, echoed = len(tasks), set()
            prompt_tokens = completion_tokens = 0
            try:
                while live:
                    i, out = await queue.get()
                    if out is None:
                        live -= 1
                        continue
                    for c in out.outputs:
                        idx = i * n + c.index
                        text = c.text
                        with_prompt = body.echo and idx not in echoed
                        if with_prompt:
                            echoed.add(idx)
                            text = echo_text(out) + text
                        completion_tokens += len(c.token_ids)
                        yield sse(
                            {
                                "id": base,
                                "object": "text_completion",
                                "created": created,
                                "model": model_name,
                                "choices": [
                                    {
                                        "index": idx,
                                        "text": text,
                                        "logprobs": choice_logprobs(out, c, with_prompt),
                                        "finish_reason": c.finish_reason,
                                        "stop_reason": c.stop_reason,
                                    }
                                ],
                            }
                        )
                    if out.finished:
                        prompt_tokens += len(out.prompt_token_ids)
                if include_usage:
                    yield sse(
                        {
                            "id": base,
                            "object": "text_completion",
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": prompt_tokens,
                                "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens,
                            },
                        }
                    )
                yield "data: [DONE]\n\n"
            finally:  # a client that went away cancels us here: abort every request
                for t in tasks:
                    t.cancel()
                for st in streams:
                    st.close()

        return StreamingResponse(stream(), media_type="text/event-stream")

    # -- /v1/chat/completions -----------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_admission(body.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            if not messages:
                raise ValueError("messages must not be empty.")
            ids = apply_chat_template(tokenizer, messages, body.add_generation_prompt, body.chat_template)
            k = body.top_logprobs if body.logprobs else None
            if body.top_logprobs is not None and not body.logprobs:
                raise ValueError("top_logprobs must be used with logprobs=true.")
            params = body.sampling_params(body.max_new_tokens(), (k or 0) if body.logprobs else None)
        except ValueError as e:
            raise _bad_request(e) from None
        except Exception as e:  # a template that fails to render is bad input, not a crash
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        st = await start({"prompt_token_ids": ids}, params, rid, body.priority)
        k = k or 0

        def lp_of(c):
            return chat_logprobs(c.logprobs or [], c.token_ids, k) if body.logprobs else None

        if not body.stream:
            (final,) = await until_finished([st], request)
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": lp_of(c),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in sorted(final.outputs, key=lambda c: c.index)
            ]
            ct = sum(len(c.token_ids) for c in final.outputs)
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": ct, "total_tokens": len(ids) + ct},
            }

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            started = set()
            ct = 0
            try:
                async for out in st:
                    for c in out.outputs:
                        delta = {"content": c.text}
                        if c.index not in started:
                            started.add(c.index)
                            delta = {"role": "assistant", "content": c.text}
                        ct += len(c.token_ids)
                        yield sse(
                            {
                                "id": rid,
                                "object": "chat.completion.chunk",
                                "created": created,
                                "model": model_name,
                                "choices": [
                                    {
                                        "index": c.index,
                                        "delta": delta,
                                        "logprobs": lp_of(c),
                                        "finish_reason": c.finish_reason,
                                    }
                                ],
                            }
                        )
                if include_usage:
                    yield sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": len(ids),
                                "completion_tokens": ct,
                                "total_tokens": len(ids) + ct,
                            },
                        }
                    )
                yield "data: [DONE]\n\n"
            finally:
                st.close()

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def serve(args) -> int:
    """`pagedserve serve`: build the engine, then run uvicorn until SIGINT/SIGTERM."""
    import os

    import uvicorn

    from pagedserve import LLM
    from pagedserve.frontend.cli import engine_kwargs

    kw = engine_kwargs(args)
    kw["model"] = args.model
    llm = LLM(**kw)
    name = args.served_model_name or (
        "SmolLM2-135M-Instruct" if args.model == "default" else os.path.basename(os.path.normpath(args.model))
    )
    app = build_app(
        AsyncLLM(llm.engine),
        name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
    )
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    # uvicorn drains on SIGTERM, then restores the previous handler and re-raises the
    # signal; a no-op handler here turns that graceful stop into exit status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    return 0
