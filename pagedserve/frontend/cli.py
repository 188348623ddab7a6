"""`pagedserve` command line: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 1024,
    "m": 1e6,
    "mb": 1e6,
    "mib": 1024**2,
    "g": 1e9,
    "gb": 1e9,
    "gib": 1024**3,
    "t": 1e12,
    "tb": 1e12,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' or a plain number of bytes."""
    m = _SIZE.match(text)
    if m is None or m.group(2) is not None and m.group(2).lower() not in _UNITS:
        try:
            return int(float(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB)") from None
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default="default", help="HF directory, GGUF file, or 'default'")
    else:
        p.add_argument(
            "--model", default="default", help="HF directory, GGUF file, or 'default' (SmolLM2-135M)"
        )
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="KV cache size, e.g. 2GiB (default 2GiB on CPU, committed as it fills)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        model=a.model,
        tokenizer=a.tokenizer,
        dtype=a.dtype,
        device=a.device,
        seed=a.seed,
        block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks,
        kv_cache_memory_bytes=a.kv_cache_memory,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        enable_prefix_caching=not a.no_prefix_caching,
        enable_chunked_prefill=not a.no_chunked_prefill,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        scheduling_policy=a.scheduling_policy,
    )


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
    from pagedserve.frontend.tokenizer import apply_chat_template
    from pagedserve.sampling_params import RequestOutputKind

    llm = LLM(**engine_kwargs(a))
    engine = llm.engine
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
    d.set_defaults(fn=lambda a: __import__("pagedserve.frontend.demo", fromlist=["main"]).main([]))

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s, model_positional=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    s.add_argument("--max-queue", type=int, default=None, help="answer 503 while this many requests wait")
    s.add_argument("--max-body-bytes", type=parse_bytes, default=16 << 20)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--log-level", default="info")
    s.set_defaults(fn=lambda a: __import__("pagedserve.server.api_server", fromlist=["serve"]).serve(a))

    b = sub.add_parser("bench", help="benchmarks (JSON output)")
    b.add_argument(
        "what",
        choices=["scheduler", "throughput", "forward", "prefix", "kv", "serve"],
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


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    module = {"scheduler": "scheduler_overhead"}.get(a.what, a.what)
    importlib.import_module(f"pagedserve.bench.{module}").main(a.rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
