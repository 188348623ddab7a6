"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncLLM: the app factory,
routes, middleware, the uvicorn server with a drain on shutdown, and `serve()`.

The endpoints live in serving_completion.py, serving_chat.py (tools: tool_calls.py),
serving_tokenize.py (/tokenize, /detokenize) and serving_models.py; what they share in
serving_base.py (the context), http_errors.py (error bodies and handlers), responses.py
(envelopes, usage, SSE, logprobs) and admission.py (--max-queue, the per-request
tracker); the ASGI guard (auth, body limit, client-disconnect watcher) in middleware.py.

Errors use OpenAI's body {"error": {message, type, param, code}} (code: a string or
null): 400 for invalid input (never a 500), 401 for a missing/bad key, 404 for an unknown
model, 413 for an oversized body (Content-Length or chunked), 503 + Retry-After when the
server is overloaded (more than max_num_seqs + --max-queue requests in flight) or
shutting down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
from dataclasses import replace

import uvicorn
from fastapi import FastAPI, Request

from pagedserve.sampling_params import SLO
from pagedserve.server.admission import AdmissionLimiter
from pagedserve.server.http_errors import install_error_handlers
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.middleware import RequestGuard, header_timeout_protocol
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedserve.server.server_config import ServerConfig
from pagedserve.server.serving_base import ServingContext
from pagedserve.server.serving_chat import OpenAIServingChat
from pagedserve.server.serving_completion import OpenAIServingCompletion
from pagedserve.server.serving_lora import (
    LoadLoRAAdapterRequest,
    OpenAIServingLoRA,
    UnloadLoRAAdapterRequest,
    parse_lora_modules,
)
from pagedserve.server.serving_messages import AnthropicServingMessages, MessagesRequest
from pagedserve.server.serving_models import OpenAIServingModels
from pagedserve.server.serving_pooling import EmbeddingRequest, RerankRequest, ScoreRequest, ServingPooling
from pagedserve.server.serving_responses import OpenAIServingResponses, ResponsesRequest
from pagedserve.server.serving_tokenize import OpenAIServingTokenization

logger = logging.getLogger(__name__)



def build_app(
    llm, model_name: str, config: ServerConfig | None = None, *, limiter: AdmissionLimiter | None = None, **overrides
) -> FastAPI:
    """The app over one AsyncLLM (only its public API is used), with `config`'s settings
    (keyword `overrides` replace single fields: `build_app(llm, name, api_key="k")`).
    `limiter` may be shared by several apps (front-end workers) over the same engine; by
    default the app makes its own with capacity max_num_seqs + max_queue (None: unbounded)."""
    cfg = replace(config or ServerConfig(), **overrides)
    if limiter is None:
        cap = None if cfg.max_queue is None else llm.config.scheduler.max_num_seqs + cfg.max_queue
        limiter = AdmissionLimiter(cap)
    if hasattr(llm, "stall_timeout_s"):
        llm.stall_timeout_s = cfg.stall_timeout
    ctx = ServingContext(
        llm,
        model_name,
        _metrics(llm, model_name, limiter),
        limiter,
        cfg.trust_request_chat_template,
        compact_json=cfg.structured_outputs_disable_any_whitespace,
        default_slo=SLO.parse(cfg.default_slo),
        request_timeout=cfg.request_timeout,
    )

    store = _response_store(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await ctx.drain(0.0)  # normally done already by APIServer.shutdown
        await asyncio.to_thread(llm.shutdown)
        if store is not None:
            store.close()

    app = FastAPI(title="pagedserve", version="0.1.0", lifespan=lifespan)
    app.state.serving = ctx
    app.state.server_config = cfg
    app.add_middleware(
        RequestGuard,
        api_key=cfg.api_key,
        max_body_bytes=cfg.max_body_bytes,
        open_paths=("/health", "/metrics") if cfg.allow_unauthenticated_metrics else ("/health",),
        on_reject=ctx.metrics.rejected,
        body_timeout=cfg.body_timeout,
        max_pending_bodies=cfg.max_pending_bodies,
        on_response=ctx.metrics.responded,
    )
    install_error_handlers(app)
    _add_routes(app, ctx, cfg.tool_call_parser, store)
    _add_lora_routes(app, ctx, cfg)
    from pagedserve.server.dashboard import add_dashboard

    add_dashboard(app, llm, model_name)  # /dashboard, when the engine publishes snapshots
    return app


def _metrics(llm, model_name: str, limiter: AdmissionLimiter) -> ServerMetrics:
    replicas = getattr(llm, "replicas", None)  # data parallelism: per-engine gauges, routing counts
    return ServerMetrics(
        lambda: llm.stats,
        model_name,
        lambda: (limiter.in_flight, limiter.capacity),
        get_engine_stats=(lambda: replicas.stats) if replicas is not None else None,
        get_routed=(lambda: replicas.routed) if replicas is not None else None,
        get_stalled=getattr(llm, "stall_reason", None),
    )


def _response_store(cfg: ServerConfig):
    if cfg.responses_store == "off":
        return None
    from pagedserve import envs
    from pagedserve.server.response_store import ResponseStore

    path = cfg.responses_store or os.path.join(envs.PAGEDSERVE_CACHE_DIR, "responses.sqlite3")
    return ResponseStore(path, cfg.responses_store_max_bytes, cfg.responses_store_max_age_days * 86400)


def _add_routes(app: FastAPI, ctx: ServingContext, tool_call_parser: str, store=None) -> None:
    completion, models = OpenAIServingCompletion(ctx), OpenAIServingModels(ctx)
    chat = OpenAIServingChat(ctx, tool_call_parser)
    tokenization = OpenAIServingTokenization(ctx, chat)
    responses, messages = OpenAIServingResponses(ctx, chat, store), AnthropicServingMessages(ctx, chat)
    pooling = ServingPooling(ctx)
    app.add_api_route("/health", models.health, methods=["GET"])
    app.add_api_route("/metrics", models.metrics, methods=["GET"])
    app.add_api_route("/v1/models", models.models, methods=["GET"])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion.create(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create(body, request)

    app.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request):
        return await messages.create(body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await pooling.embeddings(body, request)

    @app.post("/score")
    async def score(body: ScoreRequest, request: Request):
        return await pooling.score(body, request)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):

        @app.post(path)
        async def rerank(body: RerankRequest, request: Request):
            return await pooling.rerank(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await tokenization.detokenize(body)


def _add_lora_routes(app: FastAPI, ctx: ServingContext, cfg: ServerConfig) -> None:
    """--lora-modules served from the start (a bad one fails here, naming it), and the
    run-time load / unload endpoints (refused unless --allow-runtime-lora-updating)."""
    lora = OpenAIServingLoRA(ctx, cfg.allow_runtime_lora_updating)
    for name, path in parse_lora_modules(cfg.lora_modules):
        lora.add(name, path)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return await lora.load(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return await lora.unload(body)


class APIServer(uvicorn.Server):
    """uvicorn's server with the drain window: on SIGTERM/SIGINT it stops accepting, lets
    in-flight requests run for `shutdown_timeout` seconds, then ends the rest (each stream
    gets a final chunk with finish_reason "abort" and `data: [DONE]`, other requests an
    error body) before uvicorn closes the connections."""

    def __init__(
        self,
        config: uvicorn.Config,
        serving: ServingContext,
        shutdown_timeout: float = 0.0,
        exit_on_engine_death: bool = False,
        exit_on_stall: bool = False,
    ) -> None:
        super().__init__(config)
        self.exit_on_stall = exit_on_stall  # --stall-action exit
        self.serving = serving
        self.shutdown_timeout = shutdown_timeout
        # A dead engine core (an executor fault, a killed process) cannot come back in this
        # process: stop, so that `serve` exits 1 and a supervisor (systemd Restart=on-failure,
        # a k8s restartPolicy) starts a fresh server. False: keep answering 503 (/health too).
        self.exit_on_engine_death = exit_on_engine_death
        self.fault_code: str | None = None  # engine_dead / engine_stalled: why it exits, told to open requests

    @property
    def engine_died(self) -> bool:
        """It exits for an engine fault (the process's status is then 1)."""
        return self.fault_code is not None

    async def on_tick(self, counter: int) -> bool:
        llm = self.serving.llm
        if self.exit_on_engine_death and not self.should_exit and not llm.is_alive:
            logger.error("the engine core died: the server exits (status 1) for its supervisor to restart it")
            self.fault_code, self.should_exit = "engine_dead", True
        stalled = llm.stall_reason() if hasattr(llm, "stall_reason") else None  # logs when a stall starts
        if stalled is not None and self.exit_on_stall and not self.should_exit:
            logger.error("%s: the server exits (status 1, --stall-action exit)", stalled)
            self.fault_code, self.should_exit = "engine_stalled", True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()  # stop accepting; uvicorn's own shutdown below closes them again (harmless)
        # after an engine fault, requests still open end with its code (whichever of the fault
        # and this drain reaches them first), not as a plain shutdown
        error = ("server_error", self.fault_code, 503) if self.fault_code else None
        await self.serving.drain(0.0 if self.force_exit else self.shutdown_timeout, error=error)
        await super().shutdown(sockets)


def make_server(app: FastAPI, config: ServerConfig | None = None, **overrides) -> APIServer:
    """uvicorn over `app` with `config`'s address, log level and time limits (default: the
    app's own config)."""
    cfg = replace(config or app.state.server_config, **overrides)
    uv = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        http=header_timeout_protocol(cfg.header_timeout),
        timeout_graceful_shutdown=3,  # a backstop: the drain has ended every request by then
    )
    return APIServer(
        uv, app.state.serving, cfg.shutdown_timeout, not cfg.keep_alive_on_engine_death, cfg.stall_action == "exit"
    )


# -- command line ----------------------------------------------------------------------------------
def add_server_args(p: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags (server_config.py; the engine's come from the engine args)."""
    ServerConfig.add_cli_args(p)


def build_async_llm(args):
    """The served engine from the parsed command line (the one place it is built)."""
    from pagedserve.engine.async_engine import AsyncLLM
    from pagedserve.engine_args import EngineArgs

    return AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))


def serve(args) -> int:
    """`pagedserve serve`: build the engine, then run uvicorn until SIGINT/SIGTERM."""
    cfg = ServerConfig.from_cli_args(args)
    SLO.parse(cfg.default_slo)  # a bad --default-slo fails before the engine loads
    parse_lora_modules(cfg.lora_modules)  # and a malformed --lora-modules
    llm = build_async_llm(args)
    name = cfg.served_model_name or (
        "SmolLM2-135M-Instruct" if args.model == "default" else os.path.basename(os.path.normpath(args.model))
    )
    app = build_app(llm, name, cfg)
    logger.info("serving %s on http://%s:%d", name, cfg.host, cfg.port)
    server = make_server(app)
    # uvicorn stops on SIGTERM, then restores the previous handler and re-raises the
    # signal; a no-op handler here turns that graceful stop into exit status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    # Everything alive now (torch, transformers, the app: ~340k objects) never becomes garbage:
    # out of the cyclic collector's view, its full collections stop walking it while streams
    # run (a 256-stream burst: 0.6 s of full collections, pauses up to 0.43 s, before; vLLM
    # freezes its server's heap too). The engine core's process freezes its own (EngineCore).
    gc.collect()
    gc.freeze()
    server.run()
    return 1 if server.engine_died else 0
