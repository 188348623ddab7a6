"""`make demo`: continuous batching on the embedded SmolLM2-135M-Instruct.

Sixteen chat prompts of very different lengths and answer budgets are submitted at once.
The engine's story is printed as it runs (batch size, KV blocks, utilization, admissions
and completions per step), then the answers and a summary. With `--dashboard` the same
run is shown live in the browser (the `pagedserve serve` dashboard: KV page map, each
step's batch, queues, latency), served from a thread of this process.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QUESTIONS = [
    ("What is the capital of France?", 24),
    ("Name three primary colors.", 24),
    ("Write a haiku about the sea.", 48),
    ("Explain in two sentences what a hash table is.", 64),
    ("What is 12 times 12?", 16),
    ("Give me a short motivational quote.", 32),
    ("Describe the water cycle for a ten-year-old.", 96),
    ("List the planets of the solar system in order.", 64),
    ("Why is the sky blue? Answer briefly.", 64),
    ("Translate 'good morning' into Spanish and French.", 32),
    ("Write a Python function that reverses a string.", 96),
    ("What does a CPU do?", 48),
    ("Suggest a name for a friendly robot.", 16),
    ("Summarize the plot of Romeo and Juliet in three sentences.", 96),
    ("What are the benefits of regular exercise? Give four.", 80),
    ("Hello! How are you today?", 32),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    add_args(ap)
    return run(ap.parse_args(argv))


def add_args(ap: argparse.ArgumentParser) -> None:
    """The demo's flags (also `pagedserve demo ...`)."""
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="shrink the KV cache (e.g. 40) to watch preemption happen",
    )
    ap.add_argument("--dashboard", action="store_true", help="watch the run live in the browser")
    ap.add_argument("--dashboard-host", default="127.0.0.1")
    ap.add_argument("--dashboard-port", type=int, default=8008, help="0: any free port")
    ap.add_argument(
        "--step-delay", type=float, default=None, help="seconds to pause after each step (--dashboard: 0.05)"
    )
    ap.add_argument("--no-wait", action="store_true", help="--dashboard: exit at the end instead of waiting")


def run(args: argparse.Namespace) -> int:
    if args.step_delay is None:
        args.step_delay = 0.05 if args.dashboard else 0.0

    from pagedserve import LLM, SamplingParams
    from pagedserve.sampling_params import RequestOutputKind
    from pagedserve.tokenizer import apply_chat_template

    t0 = time.perf_counter()
    interval_ms = 200 if args.dashboard else 0
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        snapshot_interval_ms=interval_ms,
    )
    eng = llm.engine
    view = _Dashboard(eng, args, interval_ms) if args.dashboard else None
    print(
        f"loaded {os.path.basename(eng.model_path)} ({eng.model_config.architecture}, "
        f"{eng.core.info.dtype}) in {time.perf_counter() - t0:.1f}s; KV cache: {eng.num_blocks - 1} blocks "
        f"x {args.block_size} tokens\n"
    )

    ids = {}
    for i, (q, max_tokens) in enumerate(QUESTIONS):
        prompt = apply_chat_template(eng.tokenizer, [{"role": "user", "content": q}])
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
        ids[eng.add_request(f"q{i}", {"prompt_token_ids": prompt}, sp)] = q
    print(
        f"submitted {len(ids)} requests at once (prompts of "
        f"{min(len(apply_chat_template(eng.tokenizer, [{'role': 'user', 'content': q}])) for q, _ in QUESTIONS)}"
        f"-{max(len(apply_chat_template(eng.tokenizer, [{'role': 'user', 'content': q}])) for q, _ in QUESTIONS)}"
        " tokens, answers of 16-96 tokens)\n"
    )
    if view is not None:
        view.publish(force=True)  # the queue before the first step
    print(
        f"{'step':>4} {'batch':>5} {'tokens':>6} {'run':>4} {'wait':>4} {'KV used/total':>14} {'util':>6}  events"
    )
    results = {}
    t_start = time.perf_counter()
    step = 0
    peak_blocks = 0
    utils = []
    while eng.has_unfinished_requests():
        before = eng.engine_core.running_request_ids()
        outs = eng.step()
        s = eng.get_stats()
        step += 1
        peak_blocks = max(peak_blocks, s.kv_blocks_used)
        after = eng.engine_core.running_request_ids()
        done = [o.request_id for o in outs if o.finished]
        for o in outs:
            if o.finished:
                results[o.request_id] = o
                if view is not None:
                    view.latency.observe(o)
        if view is not None:
            view.publish()
            time.sleep(args.step_delay)
        elif args.step_delay:
            time.sleep(args.step_delay)
        joined = sorted(after - before, key=lambda x: int(x[1:]))
        events = []
        if joined:
            events.append("joined " + ",".join(joined))
        if done:
            events.append("finished " + ",".join(done))
        if s.kv_blocks_used:
            utils.append(s.kv_utilization)
        if events or step % 10 == 0 or step <= 2:
            print(
                f"{step:>4} {s.last_batch_size:>5} {s.last_num_scheduled_tokens:>6} {s.num_running:>4} "
                f"{s.num_waiting:>4} {s.kv_blocks_used:>6}/{s.kv_blocks_total:<7} "
                f"{s.kv_utilization:>6.1%}  {'; '.join(events)}"
            )
    wall = time.perf_counter() - t_start
    s = eng.get_stats()

    print("\nanswers:")
    for rid, q in ids.items():
        o = results[rid]
        text = " ".join(o.outputs[0].text.split())
        print(
            f"  [{rid}] {q}\n       -> {text[:160]}{'...' if len(text) > 160 else ''}"
            f"  ({len(o.outputs[0].token_ids)} tokens, {o.outputs[0].finish_reason})"
        )
    gen = s.generation_tokens
    print(
        f"\nsummary: {step} steps in {wall:.1f}s; {s.prompt_tokens} prompt + {gen} generated tokens "
        f"({gen / wall:.0f} generated tok/s, {(s.prompt_tokens + gen) / wall:.0f} total tok/s)"
    )
    print(
        f"  peak KV blocks {peak_blocks}/{s.kv_blocks_total}; KV utilization (stored tokens / allocated "
        f"slots) mean {sum(utils) / max(len(utils), 1):.1%}, min {min(utils, default=1):.1%}; "
        f"preemptions {s.num_preemptions}; prefix-cache hits {s.prefix_cache_hits} of "
        f"{s.prefix_cache_queries} prompt tokens"
    )
    print(
        "  short answers left the batch as soon as they finished, freeing their blocks at once,"
        " while longer ones kept going (continuous batching)."
    )
    if view is not None:
        view.publish(force=True)
        view.wait(args.no_wait)
    return 0


class _Dashboard:
    """The live view of the in-process engine core: a snapshot after a step at most every
    interval (taken here, between steps, so the page never reads a changing scheduler),
    served by the server's dashboard routes from a uvicorn thread."""

    def __init__(self, eng, args, interval_ms: int) -> None:
        # the server layer, loaded lazily as `pagedserve serve` is by the command line
        dash = importlib.import_module("pagedserve.server.dashboard")
        self.core = eng.engine_core
        self.interval = interval_ms / 1e3
        self.snapshot = self.core.snapshot()
        self.last = time.perf_counter()
        self.latency = dash.SampleLatency()
        self.server, self.url = dash.serve_standalone(
            lambda: self.snapshot,
            self.latency,
            "SmolLM2-135M-Instruct" if args.model == "default" else os.path.basename(eng.model_path),
            interval_ms,
            args.dashboard_host,
            args.dashboard_port,
        )
        print(f"dashboard: {self.url}  (live view of this run)\n")
        if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or sys.platform == "darwin":
            import webbrowser

            webbrowser.open(self.url)
        else:
            time.sleep(1.0)  # headless: a moment to open the URL before the run starts

    def publish(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.last >= self.interval:
            t0 = time.perf_counter()
            snap = self.core.snapshot()
            snap["cost_s"] = time.perf_counter() - t0
            self.snapshot, self.last = snap, now

    def wait(self, no_wait: bool) -> None:
        if not no_wait:
            print(f"\nthe dashboard stays up at {self.url}; Ctrl-C to quit")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print()
        self.server.should_exit = True


if __name__ == "__main__":
    raise SystemExit(main())
