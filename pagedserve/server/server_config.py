"""The HTTP server's settings, each written once (default, choices, help), as the engine's
are in pagedserve/config.py: `pagedserve serve`'s server flags are generated from this
dataclass, and `build_app` / `make_server` read it."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields

from pagedserve.config import add_fields_to_parser, parse_bytes, setting
from pagedserve.server.tool_calls import TOOL_PARSERS


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on every path but /health")
    allow_unauthenticated_metrics: bool = setting(False, "with --api-key: leave /metrics open")
    max_queue: int | None = setting(
        None, "admit at most max_num_seqs + N requests in flight; beyond that answer 503 with Retry-After"
    )
    max_body_bytes: int = setting(16 << 20, "largest request body (413 beyond), e.g. 16MiB", type=parse_bytes)
    served_model_name: str | None = setting(None, "the model's name in requests and /v1/models")
    log_level: str = setting("info", "uvicorn's log level")
    # -- time limits ------------------------------------------------------------------------
    shutdown_timeout: float = setting(
        0.0, "on SIGTERM, seconds in-flight requests may run before they are aborted (default 0, as vLLM)"
    )
    header_timeout: float = setting(10.0, "close connections that take longer than this to send request headers")
    body_timeout: float = setting(
        30.0, "answer 408 to a request whose body has not fully arrived this many seconds after its headers"
    )
    max_pending_bodies: int = setting(
        256, "requests whose bodies are still arriving at once (beyond: a new one waits up to 5 s for a slot, then 503)"
    )
    request_timeout: float | None = setting(
        None,
        "abort a request (queued or running) after this many seconds, freeing its KV blocks (504); "
        'a request may ask for a shorter one with the "request_timeout" body field',
    )
    stall_timeout: float = setting(
        30.0,
        "with requests in flight and no engine step finishing for max(this, 4 x the longest step seen) "
        "seconds, the engine counts as stalled: /health 503, pagedserve:engine_stalled 1",
    )
    stall_action: str = setting("report", "on a stall: report (503 on /health) | exit (status 1)", choices=("report", "exit"))
    keep_alive_on_engine_death: bool = setting(
        False, "if the engine core dies, keep serving 503 (default: exit with status 1 for a supervisor to restart)"
    )
    # -- request handling -------------------------------------------------------------------
    trust_request_chat_template: bool = setting(
        False, "accept a chat_template in requests (rendered sandboxed, with time and memory limits)"
    )
    tool_call_parser: str = setting(
        "hermes",
        "how tool calls are read from the text of chat requests with tool_choice 'auto' "
        "(hermes and qwen: <tool_call>{...}</tool_call>; llama3_json: bare JSON)",
        choices=TOOL_PARSERS,
    )
    enable_auto_tool_choice: bool = setting(
        False, "accepted for vLLM compatibility: tool_choice 'auto' is always enabled here"
    )
    structured_outputs_disable_any_whitespace: bool = setting(
        False,
        "JSON constraints (response_format, guided_json...) allow no free whitespace (small models can "
        "fill it forever; forced tool calls never do); a request's structured_outputs may say otherwise",
    )
    responses_store: str | None = setting(
        None,
        "the Responses API's store (store / previous_response_id / GET /v1/responses/{id}), an SQLite file "
        "(default: responses.sqlite3 under PAGEDSERVE_CACHE_DIR); 'off': no store",
    )
    responses_store_max_bytes: int = setting(
        256 << 20, "the store's size bound, e.g. 256MiB (the oldest responses go first)", type=parse_bytes
    )
    responses_store_max_age_days: float = setting(30.0, "stored responses older than this are deleted")
    default_slo: dict | None = setting(
        None,
        'latency targets for requests that bring no "slo" field, e.g. \'{"ttft_ms": 1000, "tpot_ms": 100}\' '
        "(scheduled first by deadline under --scheduling-policy length_aware; attainment in /metrics)",
        type=json.loads,
    )

    # -- LoRA adapters (the engine needs --enable-lora) ----------------------------------------
    lora_modules: list | None = setting(
        None,
        "LoRA adapters served under their own model names: name=path ... (or JSON "
        '\'{"name": ..., "path": ...}\'); a request\'s "model" picks one',
        type=str,
        nargs="+",
    )
    allow_runtime_lora_updating: bool = setting(
        False, "accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key)"
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_fields_to_parser(parser.add_argument_group("server"), fields(cls))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerConfig:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
