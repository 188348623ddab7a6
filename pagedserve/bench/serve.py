"""Online serving benchmark: Poisson arrivals, streaming, latency percentiles.

    pagedserve bench serve --url http://127.0.0.1:8000 --model NAME [--request-rate 2]
        [--num-requests 64] [--input-len 16 512] [--output-len 16 256] [--seed 0]
    pagedserve bench serve --launch MODEL_PATH --compare-static [--max-num-seqs 16] ...

Against any OpenAI-compatible /v1/completions (prompts are token-id lists; ignore_eos and
min_tokens make output lengths exact on servers that know vLLM's extras). --launch starts
pagedserve in this process instead; with --compare-static it runs the same arrival
trace twice, against continuous batching and against the StaticScheduler (a batch is
admitted when nothing runs, and nothing joins until it has finished), and prints ratios.
Reports TTFT, TPOT (per request), inter-token latency and end-to-end latency at
p50/p90/p99, throughput, and goodput (requests/s meeting --slo-ttft and --slo-tpot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter

from pagedserve.bench.workload import add_workload_args, make_workload


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def q(p):
        return round(s[min(len(s) - 1, int(p * len(s)))], 4)

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": round(sum(s) / len(s), 4)}


async def one_request(client, url, model, prompt, out_len, t_sched, api_key, extra: dict | None = None) -> dict:
    """One streamed completion; `extra`: more body fields (e.g. pagedserve's "slo")."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "min_tokens": out_len,
        **(extra or {}),
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    times, n_tok = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):  # one chunk per step with new tokens (text may still be held)
                times.append(time.perf_counter())
                n_tok += 1
    end = time.perf_counter()
    if not times:
        return {"ok": False, "status": 200}
    itl = [b - a for a, b in zip(times, times[1:])]
    return {
        "ok": True,
        "ttft": times[0] - t0,
        "e2e": end - t0,
        "itl": itl,
        "chunks": n_tok,
        "tokens": out_len,
        "tpot": (end - times[0]) / max(out_len - 1, 1),
        "queue_delay": t0 - t_sched,
    }


async def run_load(
    url, model, work, rate: float, seed: int, api_key=None, timeout=600, max_concurrency: int | None = None
) -> dict:
    import httpx

    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency or len(work) or 1)

    async def gated(*args):
        async with gate:
            return await one_request(*args)

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000)) as client:
        t_start = time.perf_counter()
        tasks, t = [], t_start
        for prompt, out_len in work:
            if rate != float("inf"):
                t += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(gated(client, url, model, prompt, out_len, t, api_key)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
    return {"results": results, "duration": duration}


def warm_up(url, model, work, api_key=None) -> None:
    """One short request before the clock starts, as vLLM's client does: the server's first
    request pays one-time costs (JIT-compiled GPU kernels, lazily built state) that are not
    serving throughput."""
    if work:
        load = asyncio.run(run_load(url, model, [(work[0][0], 2)], float("inf"), 0, api_key))
        if not load["results"][0]["ok"]:
            raise RuntimeError(f"the warm-up request failed: {load['results'][0]}")


def summarize(load: dict, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in load["results"] if r["ok"]]
    dur = load["duration"]
    good = [r for r in ok if r["ttft"] <= slo_ttft and r["tpot"] <= slo_tpot]
    return {
        "completed": len(ok),
        "failed": len(load["results"]) - len(ok),
        "failed_by_status": dict(Counter(str(r["status"]) for r in load["results"] if not r["ok"])),
        "duration_s": round(dur, 2),
        "request_throughput": round(len(ok) / dur, 3),
        "output_tok_s": round(sum(r["tokens"] for r in ok) / dur, 1),
        "goodput_req_s": round(len(good) / dur, 3),
        "ttft_s": percentiles([r["ttft"] for r in ok]),
        "tpot_s": percentiles([r["tpot"] for r in ok]),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
    }


def server_flags(args: list[str]) -> dict:
    """--server-arg values ("--max-num-seqs=64", or a bare switch such as
    "--no-kv-cache-prefault") as LocalServer keyword arguments."""
    flags = {}
    for f in args:
        name, _, value = f.lstrip("-").partition("=")
        if not _ and name.startswith("no-"):  # --no-X: X off
            flags[name[3:].replace("-", "_")] = False
        else:
            flags[name.replace("-", "_")] = value if _ else True
    return flags


class LocalServer:
    """`pagedserve serve` in a child process on a free loopback port (the load generator
    stays out of the server's processes, as with any real client)."""

    def __init__(self, model: str, scheduling: str = "continuous", engine_core_process: bool = True, **flags) -> None:
        import os
        import socket
        import subprocess
        import sys

        import httpx

        from pagedserve.bench.static_scheduler import STATIC_SCHEDULER_CLS

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if scheduling == "static":
            flags["scheduler_cls"] = STATIC_SCHEDULER_CLS
        argv = [sys.executable, "-m", "pagedserve.frontend.cli", "serve", model, "--port", str(port)]
        argv += ["--served-model-name", "bench", "--log-level", "warning"]
        argv += ["--engine-core-process" if engine_core_process else "--no-engine-core-process"]
        for k, v in flags.items():
            name = k.replace("_", "-")
            if isinstance(v, bool):  # a switch: --flag / --no-flag
                argv.append(("--" if v else "--no-") + name)
            elif v is not None:
                argv += ["--" + name, str(v)]
        self.proc = subprocess.Popen(argv, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise TimeoutError("server did not start")
            time.sleep(0.2)

    def stop(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except Exception:  # noqa: BLE001
            self.proc.kill()


def run_offline(model: str, work, **engine_kw) -> dict:
    """The same workload through LLM.generate in this process: the ceiling for a server."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, **engine_kw)
    llm.generate([{"prompt_token_ids": work[0][0][:16]}], SamplingParams(max_tokens=2), use_tqdm=False)
    sps = [SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0) for _, o in work]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], sps, use_tqdm=False)
    dur = time.perf_counter() - t
    llm.shutdown()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"duration_s": round(dur, 2), "output_tok_s": round(n_out / dur, 1)}


def plot(runs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, load in runs.items():
        ok = [r for r in load["results"] if r["ok"]]
        for ax, key in zip(axes, ("ttft", "e2e")):
            xs = sorted(r[key] for r in ok)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    for ax, title in zip(axes, ("time to first token", "end-to-end latency")):
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"CDF of {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None)
    ap.add_argument("--model", default=None, help="model name sent to --url")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--launch", default=None, help="start `pagedserve serve` with this model")
    ap.add_argument("--compare-static", action="store_true")
    ap.add_argument(
        "--compare-offline", action="store_true", help="also run the workload through LLM.generate; print the ratio"
    )
    ap.add_argument(
        "--engine-core",
        choices=["process", "thread", "both"],
        default="process",
        help="the launched server's engine core: its own process (default) or a thread",
    )
    ap.add_argument("--max-concurrency", type=int, default=None, help="streams in flight at most")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--server-arg", action="append", default=[], help="more `pagedserve serve` flags, e.g. --num-kv-blocks=512"
    )
    add_workload_args(ap, num_requests=64)
    ap.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once"
    )
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-tpot", type=float, default=0.2)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    if not a.url and not a.launch:
        ap.error("give --url (a running server) or --launch MODEL")
    vocab = 1000
    if a.launch:
        from pagedserve.executor.loader import load_hf_config_dict, resolve_model_path

        vocab = load_hf_config_dict(resolve_model_path(a.launch))["vocab_size"]
    work = make_workload(a, vocab)
    flags = server_flags(a.server_arg)
    runs = {}
    offline = None
    if a.url:
        warm_up(a.url, a.model, work, a.api_key)
        runs["server"] = asyncio.run(
            run_load(a.url, a.model, work, a.request_rate, a.seed, a.api_key, max_concurrency=a.max_concurrency)
        )
    else:
        cores = ["process", "thread"] if a.engine_core == "both" else [a.engine_core]
        modes = [("continuous", c) for c in cores] + ([("static", cores[0])] if a.compare_static else [])
        for mode, core in modes:
            name = mode if len(cores) == 1 else f"{mode}_{core}"
            srv = LocalServer(
                a.launch, mode, core == "process", dtype=a.dtype, max_num_seqs=a.max_num_seqs, **flags
            )
            try:
                warm_up(srv.url, "bench", work)
                runs[name] = asyncio.run(
                    run_load(srv.url, "bench", work, a.request_rate, a.seed, max_concurrency=a.max_concurrency)
                )
            finally:
                srv.stop()
        if a.compare_offline:
            # on the server's KV cache: its size if given, committed at start unless told not to
            kv = {"kv_cache_prefault": flags.get("kv_cache_prefault", True)}
            if "num_kv_blocks" in flags:
                kv["num_kv_blocks"] = int(flags["num_kv_blocks"])
            # the weights and the device the server was told to use (random 8B-shaped weights on a GPU)
            kv |= {k: flags[k] for k in ("load_format", "device") if k in flags}
            offline = run_offline(a.launch, work, dtype=a.dtype, max_num_seqs=a.max_num_seqs, **kv)
    out = {
        "bench": "serve",
        "request_rate": a.request_rate,
        "num_requests": a.num_requests,
        "max_num_seqs": a.max_num_seqs,
        "max_concurrency": a.max_concurrency,
        "runs": {k: summarize(v, a.slo_ttft, a.slo_tpot) for k, v in runs.items()},
    }
    if offline is not None:
        out["offline"] = offline
        for k, r in out["runs"].items():
            out[f"{k}_over_offline"] = round(r["output_tok_s"] / offline["output_tok_s"], 3)
    if "static" in out["runs"]:
        c, s = out["runs"]["continuous"], out["runs"]["static"]
        out["ttft_p50_static_over_continuous"] = round(s["ttft_s"]["p50"] / c["ttft_s"]["p50"], 2)
        out["throughput_continuous_over_static"] = round(c["output_tok_s"] / s["output_tok_s"], 2)
    print(json.dumps(out), flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(json.dumps(out) + "\n")
    if a.plot:
        plot(runs, a.plot)


if __name__ == "__main__":
    main()
