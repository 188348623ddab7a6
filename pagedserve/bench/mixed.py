"""Mixed short and long requests through the HTTP server, open loop: does a chat turn
wait behind a document? (issue 29; the seed's "serve short and long requests apart").

    pagedserve bench mixed [--model default] [--policy fcfs|length_aware|...] [--rate 0.6]
        [--num-requests 120] [--seed 0] [--slo-ttft-ms 1000] [--out r.json] [--plot r.png]
    pagedserve bench mixed --url http://127.0.0.1:8000 --served-model NAME ...  (any server)
    pagedserve bench mixed --compare fcfs=a.json length_aware=b.json --plot ab.png  (runs side by side)

Seeded workload: Poisson arrivals at --rate; 80% short chat turns (prompts 32-256 tokens,
outputs 8-64) and 20% long jobs (prompts 1,500-3,000, outputs 300-800), as token-id
prompts with ignore_eos and min_tokens so every server does the same work. Without --url
it starts `pagedserve serve` with the given policy (and --server-arg flags). Reports per
class p50/p90/p99 TTFT, TPOT and end-to-end latency, output throughput, the short
requests' TTFT attainment of --slo-ttft-ms (sent as pagedserve's "slo" field with
--send-slo), and the server's preemptions when its /metrics names them; --plot draws the
per-class latency distributions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re

from pagedserve.bench.serve import LocalServer, one_request, percentiles, server_flags

SHORT, LONG = "short", "long"


def make_mixed_workload(n: int, seed: int, vocab: int = 49152, long_share: float = 0.2) -> list[dict]:
    """n requests: {"cls", "prompt" (token ids), "out"}; the same list for the same seed."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        cls = LONG if rng.random() < long_share else SHORT
        n_prompt = rng.randint(1500, 3000) if cls == LONG else rng.randint(32, 256)
        out = rng.randint(300, 800) if cls == LONG else rng.randint(8, 64)
        work.append({"cls": cls, "prompt": [rng.randrange(100, vocab - 100) for _ in range(n_prompt)], "out": out})
    return work


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which the n requests are sent (Poisson at `rate`)."""
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def run_mixed(url, model, work, rate: float, seed: int, slo_ttft_ms: float | None, timeout=1800) -> dict:
    import time

    import httpx

    extra = {"slo": {"ttft_ms": slo_ttft_ms, "name": "short_chat"}} if slo_ttft_ms else None
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000)) as client:
        t_start = time.perf_counter()
        tasks = []
        for w, offset in zip(work, arrival_times(len(work), rate, seed)):
            t = t_start + offset
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            ex = extra if w["cls"] == SHORT else None
            tasks.append(asyncio.create_task(one_request(client, url, model, w["prompt"], w["out"], t, None, ex)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
    for w, r in zip(work, results):
        r["cls"] = w["cls"]
    return {"results": results, "duration": duration}


def summarize_mixed(load: dict, slo_ttft_ms: float | None) -> dict:
    res, dur = load["results"], load["duration"]
    ok = [r for r in res if r["ok"]]
    out = {
        "completed": len(ok),
        "failed": len(res) - len(ok),
        "duration_s": round(dur, 1),
        "output_tok_s": round(sum(r["tokens"] for r in ok) / dur, 1),
    }
    for cls in (SHORT, LONG):
        rs = [r for r in ok if r["cls"] == cls]
        out[cls] = {
            "n": len(rs),
            "ttft_s": percentiles([r["ttft"] for r in rs]),
            "tpot_s": percentiles([r["tpot"] for r in rs]),
            "e2e_s": percentiles([r["e2e"] for r in rs]),
        }
    if slo_ttft_ms:
        shorts = [r for r in ok if r["cls"] == SHORT]
        met = sum(r["ttft"] * 1e3 <= slo_ttft_ms for r in shorts)
        out["short_ttft_slo"] = {"target_ms": slo_ttft_ms, "attained": met, "of": len(shorts)}
    return out


def preemptions(url: str) -> float | None:
    """The server's preemption counter, pagedserve's or vLLM's name."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    m = re.search(r"^(?:pagedserve:num_preemptions|vllm:num_preemptions)(?:_total)?(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


def plot(loads: dict[str, dict], path: str) -> None:
    """Per-class CDFs of TTFT and TPOT, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for name, load in loads.items():
        for row, cls in enumerate((SHORT, LONG)):
            rs = [r for r in load["results"] if r["ok"] and r["cls"] == cls]
            for col, key in enumerate(("ttft", "tpot")):
                xs = sorted(r[key] for r in rs)
                axes[row][col].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
                axes[row][col].set_title(f"{cls} requests: {key.upper()} (s)")
    for ax in axes.flat:
        ax.set_xscale("log")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="an OpenAI-compatible server (default: start pagedserve)")
    ap.add_argument("--served-model", default="bench")
    ap.add_argument("--model", default="default")
    ap.add_argument("--policy", default="fcfs", help="pagedserve's --scheduling-policy")
    ap.add_argument("--server-arg", action="append", default=[], help="more `pagedserve serve` flags, e.g. --max-num-seqs=64")
    ap.add_argument("--rate", type=float, default=0.6, help="requests per second (Poisson)")
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="short requests' TTFT target (attainment)")
    ap.add_argument("--send-slo", action="store_true", help="send the target as pagedserve's slo field")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--compare", nargs="+", metavar="NAME=FILE", help="draw saved runs (--out files) in one --plot; run nothing")
    a = ap.parse_args(argv)
    if a.compare:
        loads = {}
        for item in a.compare:
            name, path = item.split("=", 1)
            with open(path) as f:
                loads[name] = json.load(f)
        plot(loads, a.plot or "mixed.png")
        return
    work = make_mixed_workload(a.num_requests, a.seed)
    server = None
    if a.url is None:
        server = LocalServer(a.model, scheduling_policy=a.policy, **server_flags(a.server_arg))
        url, name = server.url, "bench"
    else:
        url, name = a.url.rstrip("/"), a.served_model
    try:
        load = asyncio.run(run_mixed(url, name, work, a.rate, a.seed, a.slo_ttft_ms if a.send_slo else None))
        res = {"bench": "mixed", "policy": a.policy if server else a.url, "rate": a.rate, "seed": a.seed}
        res |= summarize_mixed(load, a.slo_ttft_ms) | {"preemptions": preemptions(url)}
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": res, "results": load["results"]}, f)
    if a.plot:
        plot({res["policy"]: load}, a.plot)


if __name__ == "__main__":
    main()
