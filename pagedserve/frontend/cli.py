"""`pagedserve` command line: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedserve.engine_args import EngineArgs  # noqa: E402


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """The engine flags, generated from EngineArgs (one flag per field)."""
    EngineArgs.add_cli_args(p, model_positional)


def engine_kwargs(a: argparse.Namespace) -> dict:
    """The parsed engine flags as `LLM(**kwargs)` keywords."""
    return dataclasses.asdict(EngineArgs.from_cli_args(a))


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)


def sampling_params(a: argparse.Namespace, **extra):
    from pagedserve import SamplingParams

    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.sampling_seed,
        **extra,
    )


def cmd_generate(a: argparse.Namespace) -> int:
    from pagedserve import LLM

    llm = LLM(**engine_kwargs(a))
    prompts = a.prompt or [sys.stdin.read()]
    outs = llm.generate(prompts, sampling_params(a), use_tqdm=len(prompts) > 1)
    for o in outs:
        if len(prompts) > 1:
            print(f"### {o.prompt!r}")
        print(o.outputs[0].text)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from pagedserve import LLM
    from pagedserve.sampling_params import RequestOutputKind
    from pagedserve.tokenizer import apply_chat_template

    llm = LLM(**engine_kwargs(a))
    engine = llm.engine
    if engine.tokenizer is None:
        raise ValueError("chat needs a tokenizer (drop --skip-tokenizer-init).")
    history: list[dict] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("pagedserve chat: type a message, /reset to clear the history, /exit or Ctrl-D to quit.")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if a.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = apply_chat_template(engine.tokenizer, history)
        rid = engine.add_request(
            None, {"prompt_token_ids": ids}, sampling_params(a, output_kind=RequestOutputKind.DELTA)
        )
        reply = []
        try:
            while engine.has_unfinished_requests():
                for o in engine.step():
                    piece = o.outputs[0].text if o.outputs else ""
                    reply.append(piece)
                    print(piece, end="", flush=True)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedserve", description="LLM inference and serving engine.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); stdin if none")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=256)
    c.add_argument("--system", default=None, help="a system prompt")
    c.set_defaults(fn=cmd_chat)

    d = sub.add_parser("demo", help="the continuous-batching demo on the default model")
    from pagedserve.frontend import demo

    demo.add_args(d)  # --dashboard, --num-kv-blocks, ...
    d.set_defaults(fn=demo.run)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s, model_positional=True)
    serve_fn = cmd_serve
    try:  # the server's own flags; the engine commands work without the server extra
        __import__("pagedserve.server.api_server", fromlist=["add_server_args"]).add_server_args(s)
    except ImportError as e:
        serve_fn = lambda a, e=e: _no_server(e)  # noqa: E731
    s.add_argument(
        "--no-dashboard", action="store_true", help="no /dashboard (the engine publishes no state snapshots)"
    )
    s.set_defaults(fn=serve_fn, snapshot_interval_ms=250)  # the live view is on by default

    b = sub.add_parser("bench", help="benchmarks (JSON output)")
    b.add_argument(
        "what",
        choices=["scheduler", "throughput", "forward", "prefix", "kv", "serve", "spec", "soak", "dp", "mixed", "embed", "lora"],
        help="which benchmark",
    )
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)

    a = ap.parse_args(argv)
    try:
        return a.fn(a) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2


def cmd_serve(a: argparse.Namespace) -> int:
    if a.no_dashboard:
        a.snapshot_interval_ms = 0
    return __import__("pagedserve.server.api_server", fromlist=["serve"]).serve(a)


def _no_server(err: ImportError) -> int:
    print(f"pagedserve serve needs the server extra (pip install 'pagedserve[server]'): {err}", file=sys.stderr)
    return 2


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    module = {"scheduler": "scheduler_overhead"}.get(a.what, a.what)
    importlib.import_module(f"pagedserve.bench.{module}").main(a.rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
