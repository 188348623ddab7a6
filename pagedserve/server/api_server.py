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
import json
import logging
import os
import signal

import uvicorn
from fastapi import FastAPI, Request

from pagedserve.config import parse_bytes
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
from pagedserve.server.serving_base import ServingContext
from pagedserve.server.serving_chat import OpenAIServingChat
from pagedserve.server.serving_completion import OpenAIServingCompletion
from pagedserve.server.serving_models import OpenAIServingModels
from pagedserve.server.serving_tokenize import OpenAIServingTokenization
from pagedserve.server.tool_calls import TOOL_PARSERS

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 0.0  # vLLM's default: abort in-flight requests at once on SIGTERM
DEFAULT_HEADER_TIMEOUT = 10.0


def build_app(
    llm,
    model_name: str,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = 16 << 20,
    *,
    trust_request_chat_template: bool = False,
    allow_unauthenticated_metrics: bool = False,
    limiter: AdmissionLimiter | None = None,
    tool_call_parser: str = "hermes",
    structured_outputs_disable_any_whitespace: bool = False,
    default_slo: dict | None = None,
) -> FastAPI:
    """The app over one AsyncLLM (only its public API is used). `limiter` may be shared by
    several apps (front-end workers) over the same engine; by default the app makes its own
    with capacity max_num_seqs + max_queue (None: unbounded). `tool_call_parser` reads
    tool calls out of the text of chat requests with tool_choice "auto";
    `structured_outputs_disable_any_whitespace` makes JSON constraints compact (no free
    whitespace, which small models can fill forever) unless a request says otherwise."""
    if limiter is None:
        cap = None if max_queue is None else llm.config.scheduler.max_num_seqs + max_queue
        limiter = AdmissionLimiter(cap)
    ctx = ServingContext(
        llm,
        model_name,
        _metrics(llm, model_name, limiter),
        limiter,
        trust_request_chat_template,
        compact_json=structured_outputs_disable_any_whitespace,
        default_slo=SLO.parse(default_slo),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await ctx.drain(0.0)  # normally done already by APIServer.shutdown
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="pagedserve", version="0.1.0", lifespan=lifespan)
    app.state.serving = ctx
    open_paths = ("/health", "/metrics") if allow_unauthenticated_metrics else ("/health",)
    app.add_middleware(
        RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes, open_paths=open_paths, on_reject=ctx.metrics.rejected
    )
    install_error_handlers(app)
    _add_routes(app, ctx, tool_call_parser)
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
    )


def _add_routes(app: FastAPI, ctx: ServingContext, tool_call_parser: str) -> None:
    completion, models = OpenAIServingCompletion(ctx), OpenAIServingModels(ctx)
    chat = OpenAIServingChat(ctx, tool_call_parser)
    tokenization = OpenAIServingTokenization(ctx, chat)
    app.add_api_route("/health", models.health, methods=["GET"])
    app.add_api_route("/metrics", models.metrics, methods=["GET"])
    app.add_api_route("/v1/models", models.models, methods=["GET"])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion.create(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await tokenization.detokenize(body)


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
    ) -> None:
        super().__init__(config)
        self.serving = serving
        self.shutdown_timeout = shutdown_timeout
        # A dead engine core (an executor fault, a killed process) cannot come back in this
        # process: stop, so that `serve` exits 1 and a supervisor (systemd Restart=on-failure,
        # a k8s restartPolicy) starts a fresh server. False: keep answering 503 (/health too).
        self.exit_on_engine_death = exit_on_engine_death
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        if self.exit_on_engine_death and not self.should_exit and not self.serving.llm.is_alive:
            logger.error("the engine core died: the server exits (status 1) for its supervisor to restart it")
            self.engine_died = self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()  # stop accepting; uvicorn's own shutdown below closes them again (harmless)
        await self.serving.drain(0.0 if self.force_exit else self.shutdown_timeout)
        await super().shutdown(sockets)


def make_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    exit_on_engine_death: bool = False,
) -> APIServer:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=header_timeout_protocol(header_timeout),
        timeout_graceful_shutdown=3,  # a backstop: the drain has ended every request by then
    )
    return APIServer(config, app.state.serving, shutdown_timeout, exit_on_engine_death)


# -- command line ----------------------------------------------------------------------------------
def add_server_args(p: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags (the engine's come from the engine args)."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every path but /health"
    )
    g.add_argument(
        "--allow-unauthenticated-metrics", action="store_true", help="with --api-key: leave /metrics open"
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="admit at most max_num_seqs + N requests in flight; beyond that answer 503 with Retry-After",
    )
    g.add_argument("--max-body-bytes", type=parse_bytes, default=16 << 20)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--log-level", default="info")
    _add_behaviour_args(g)


def _add_behaviour_args(g) -> None:
    """Shutdown, timeouts, chat templates, tools and structured outputs, engine death."""
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGTERM, seconds in-flight requests may run before they are aborted (default 0, as vLLM)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="close connections that take longer than this to send request headers",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in requests (rendered sandboxed, with time and memory limits)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default="hermes",
        help="how tool calls are read from the text of chat requests with tool_choice 'auto' "
        "(hermes and qwen: <tool_call>{...}</tool_call>; llama3_json: bare JSON)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice 'auto' is always enabled here",
    )
    g.add_argument(
        "--structured-outputs-disable-any-whitespace",
        action="store_true",
        help="JSON constraints (response_format, guided_json...) allow no free whitespace "
        "(small models can fill it forever; forced tool calls never do); a request's "
        "structured_outputs may say otherwise",
    )
    g.add_argument(
        "--default-slo",
        type=json.loads,
        default=None,
        help='latency targets for requests that bring no "slo" field, e.g. \'{"ttft_ms": 1000, "tpot_ms": 100}\' '
        "(scheduled first by deadline under --scheduling-policy length_aware; attainment in /metrics)",
    )
    g.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="if the engine core dies, keep serving 503 (default: exit with status 1 for a supervisor to restart)",
    )


def build_async_llm(args):
    """The served engine from the parsed command line (the one place it is built)."""
    from pagedserve.engine.async_engine import AsyncLLM
    from pagedserve.engine_args import EngineArgs

    return AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))


def serve(args) -> int:
    """`pagedserve serve`: build the engine, then run uvicorn until SIGINT/SIGTERM."""
    llm = build_async_llm(args)
    name = args.served_model_name or (
        "SmolLM2-135M-Instruct" if args.model == "default" else os.path.basename(os.path.normpath(args.model))
    )
    app = build_app(
        llm,
        name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        allow_unauthenticated_metrics=args.allow_unauthenticated_metrics,
        tool_call_parser=getattr(args, "tool_call_parser", "hermes"),
        structured_outputs_disable_any_whitespace=getattr(
            args, "structured_outputs_disable_any_whitespace", False
        ),
        default_slo=getattr(args, "default_slo", None),
    )
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    server = make_server(
        app,
        args.host,
        args.port,
        args.log_level,
        args.shutdown_timeout,
        args.header_timeout,
        exit_on_engine_death=not getattr(args, "keep_alive_on_engine_death", False),
    )
    # uvicorn stops on SIGTERM, then restores the previous handler and re-raises the
    # signal; a no-op handler here turns that graceful stop into exit status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 1 if server.engine_died else 0
