"""`bench mixed` in simulation: its seeded workload replayed through the real scheduler on a
step-time model fitted from a server's step log, so a scheduling policy's settings are
tried in seconds instead of a three-minute run each (then checked with real runs).

    pagedserve bench mixed --policy fcfs --server-arg=--step-log=steps.jsonl ...   (any real run)
    python -m pagedserve.bench.mixed_sim fit steps.jsonl [more.jsonl] --out cost.json
    python -m pagedserve.bench.mixed_sim run --cost cost.json [--rate 1.1] [--seed 0]
        [--num-requests 200] [--policies fcfs length_aware] [--set long_lane_period=12 ...]

The step-time model: core/step_cost.py's features (the one the length-aware policy fits
online), plus the loop's time between steps. Fitted by least squares; `fit` prints its
rms error and how well it predicts each log's total.
The simulation: `bench mixed`'s arrivals and requests (same seed, same lists); each step's
batch is what the scheduler (its real code and policy, on a virtual clock) decides; a token
counts at the end of the step that made it. It prints `bench mixed`'s summary, so a
simulated and a real run read alike. What it does not model: the HTTP front end, run to run
noise, memory limits below 5,800 KV blocks (the default model's 2 GiB cache).
"""

from __future__ import annotations

import argparse
import json
import statistics

from pagedserve.core.step_cost import FEATURES, step_features


def read_log(path: str) -> list[tuple[float, float, list]]:
    with open(path) as f:
        return [tuple(json.loads(line)) for line in f if line.strip()]


def fit(paths: list[str]) -> dict:
    """The step-time model of the logs' steps: {"coef": {feature: seconds}, "overhead_s",
    "rms_ms", "steps"}."""
    import numpy as np

    logs = [read_log(p) for p in paths]
    x = np.array([step_features(rows) for log in logs for _, _, rows in log])
    y = np.array([sec for log in logs for _, sec, _ in log])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    gaps = [
        b[0] - a[0] - b[1] for log in logs for a, b in zip(log, log[1:]) if 0 <= b[0] - a[0] - b[1] < 0.01
    ]  # back-to-back steps only: the loop's own time, not idle waits
    return {
        "coef": dict(zip(FEATURES, coef.tolist())),
        "overhead_s": statistics.median(gaps) if gaps else 0.0,
        "rms_ms": float(np.sqrt(((x @ coef - y) ** 2).mean()) * 1000),
        "steps": len(y),
        "logs": [{"path": p, "seconds": sum(s for _, s, _ in log)} for p, log in zip(paths, logs)],
    }


def step_seconds(cost: dict, rows) -> float:
    coef = cost["coef"]
    return sum(coef[k] * v for k, v in zip(FEATURES, step_features(rows))) + cost["overhead_s"]


def simulate(cost: dict, policy: str, rate: float, num_requests: int = 200, seed: int = 0, **settings) -> dict:
    """`bench mixed`'s run with `policy` (and SchedulerConfig `settings`) on the model:
    its {"results": [...], "duration"} (the shape summarize_mixed takes)."""
    from pagedserve.bench.mixed import arrival_times, make_mixed_workload
    from pagedserve.config import CacheConfig, SchedulerConfig
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler import Scheduler
    from pagedserve.messages import ModelRunnerOutput
    from pagedserve.sampling_params import SamplingParams

    now = [0.0]
    cfg = SchedulerConfig(**({"max_num_batched_tokens": 2048, "max_model_len": 8192} | settings | {"scheduling_policy": policy}))
    sched = Scheduler(cfg, CacheConfig(block_size=16), 5800, clock=lambda: now[0])
    work = make_mixed_workload(num_requests, seed)
    arrivals = arrival_times(num_requests, rate, seed)
    reqs: dict[str, tuple[int, Request]] = {}
    first, last = {}, {}
    i = 0
    while i < len(work) or sched.has_unfinished_requests():
        while i < len(work) and arrivals[i] <= now[0]:
            w = work[i]
            params = SamplingParams(max_tokens=w["out"], min_tokens=w["out"], ignore_eos=True)
            r = Request(f"r{i}", w["prompt"], params, arrival_time=arrivals[i], max_tokens=w["out"])
            reqs[r.request_id] = (i, r)
            sched.add_request(r)
            i += 1
        so = sched.schedule()
        if not so.scheduled:  # idle until the next arrival
            if i == len(work):
                raise RuntimeError("the scheduler left requests unscheduled with nothing more to arrive")
            now[0] = arrivals[i]
            continue
        rows = [[0, len(sr.token_ids), sr.num_computed_tokens] for sr in so.scheduled]
        seconds = step_seconds(cost, rows)
        now[0] += seconds
        sched.observe_step_seconds(so, seconds - cost["overhead_s"])  # what the engine core measures
        sched.update_from_output(so, ModelRunnerOutput({sr.req_id: 7 for sr in so.scheduled if sr.sample}))
        for sr in so.scheduled:
            if sr.sample:
                k = reqs[sr.req_id][0]
                first.setdefault(k, now[0])
                last[k] = now[0]
    results = []
    for k, w in enumerate(work):
        ttft, e2e = first[k] - arrivals[k], last[k] - arrivals[k]
        tpot = (last[k] - first[k]) / max(1, w["out"] - 1)
        results.append({"ok": True, "cls": w["cls"], "tokens": w["out"], "ttft": ttft, "tpot": tpot, "e2e": e2e})
    return {"results": results, "duration": now[0]}


def _setting(item: str) -> tuple[str, object]:
    key, value = item.split("=", 1)
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def main(argv: list[str] | None = None) -> None:
    from pagedserve.bench.mixed import summarize_mixed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit the step-time model on step logs")
    f.add_argument("logs", nargs="+")
    f.add_argument("--out", default="step_cost.json")
    r = sub.add_parser("run", help="simulate bench mixed on a fitted model")
    r.add_argument("--cost", required=True)
    r.add_argument("--rate", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--num-requests", type=int, default=200)
    r.add_argument("--policies", nargs="+", default=["fcfs", "length_aware"])
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a SchedulerConfig field, for every policy")
    r.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    a = ap.parse_args(argv)
    if a.cmd == "fit":
        model = fit(a.logs)
        with open(a.out, "w") as fh:
            json.dump(model, fh, indent=1)
        print(json.dumps(model))
        return
    with open(a.cost) as fh:
        cost = json.load(fh)
    settings = dict(_setting(s) for s in a.set)
    for policy in a.policies:
        load = simulate(cost, policy, a.rate, a.num_requests, a.seed, **settings)
        res = {"bench": "mixed_sim", "policy": policy, "rate": a.rate, "seed": a.seed, "settings": settings}
        print(json.dumps(res | summarize_mixed(load, a.slo_ttft_ms)))


if __name__ == "__main__":
    main()
