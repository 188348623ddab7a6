"""Soak test of the server: rounds of concurrent streams, clients hanging up, bad inputs.

    pagedserve bench soak [--launch MODEL | --url URL --model NAME [--pid PID]]
        [--rounds 5] [--streams 200] [--hangup 0.3] [--max-tokens 16 128]
        [--prompt-words 4 300] [--seed 0] [--settle 30] [--output-json FILE]

Each round sends N streaming requests at once, chat and completion mixed, of varied
prompt and output lengths; a share of the clients (--hangup) close their connection at a
random point of their stream (before the first token included). While they run, the
regression inputs of issue 17 (top_k = 2**63, lone surrogates, NaN temperature, float and
boolean token ids, an oversized body with Content-Length and chunked) are sent, each
followed by a short normal request: each must get a 4xx with an OpenAI error body, and
the probe a 200. After the round the soak waits for the engine to settle and reads:

  * /metrics: running, waiting, kv_blocks_used (blocks still held after the settle
    window are leaks; blocks kept only by the prefix cache are free in the block pool
    (ref count 0, in the free queue) and not counted as used), generation_tokens_total;
  * the server's RSS (its process and children: the engine core), via psutil (--launch,
    or --pid for a server started elsewhere). A server commits its KV cache at start;
    one run with --no-kv-cache-prefault commits pages only when a block is first written,
    and the block pool hands out the least recently used block first, so its RSS climbs
    round after round until every block has been used once: for a leak check then, give it
    a KV cache that round 1 cycles through (--num-kv-blocks about the blocks one round
    allocates), or read the front end's growth (`server_mb`) apart;
  * latency of the streams that ran to the end: p50, p99, the slowest over the p99.

Tokens generated after hang-ups are estimated from the counter: tokens generated in the
round minus the tokens the clients received (usage of whole streams, token chunks read
by the clients that left, the probes' usage).

The JSON report carries one record per round and a verdict against the issue's goals: no
5xx, only OpenAI error bodies, every bad input a 4xx and every probe answered, every
completed stream whole, 0 leaked blocks, RSS growth after round 2 under 2%, no stream
slower than 3x its round's p99. `run_soak()` is the same in-process (tests/e2e/test_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field

import httpx

_TEXT = (
    "the quick brown fox jumps over a lazy dog while paged attention keeps every key and value "
    "in fixed blocks so that many requests share one cache and the scheduler admits new work "
    "each step tell me a story about rivers mountains cities machines music and the sea"
)
WORDS = tuple(_TEXT.split())

BAD_BODY_MIB = 20  # over the server's default 16 MiB limit


@dataclass
class SoakConfig:
    url: str
    model: str
    rounds: int = 5
    streams: int = 200
    hangup: float = 0.3  # share of clients that leave mid-stream
    max_tokens: tuple[int, int] = (16, 128)
    prompt_words: tuple[int, int] = (4, 300)
    seed: int = 0
    settle_s: float = 30.0  # how long the engine may take to free everything after a round
    api_key: str | None = None
    pid: int | None = None  # the server's process, for RSS (its children are counted too)
    bad_inputs: bool = True
    request_timeout_s: float = 600.0
    duration_s: float | None = None  # keep starting rounds (up to `rounds`) until this long has passed
    goals: dict = field(
        default_factory=lambda: {"rss_growth_after_round2": 0.02, "slowest_over_p99": 3.0, "leaked_blocks": 0}
    )


# -- requests ----------------------------------------------------------------------------------
def _prompt(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _request(cfg: SoakConfig, rng: random.Random, i: int) -> tuple[str, dict]:
    """One stream's path and body: chat or completion, varied lengths and sampling."""
    max_tokens = rng.randint(*cfg.max_tokens)
    common = {
        "model": cfg.model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "ignore_eos": rng.random() < 0.5,
        "seed": rng.randrange(1 << 31),
    }
    if rng.random() < 0.3:
        common["top_p"] = 0.9
    if rng.random() < 0.5:
        msgs = [{"role": "user", "content": f"[{i}] " + _prompt(rng, *cfg.prompt_words)}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        return "/v1/chat/completions", {**common, "messages": msgs}
    return "/v1/completions", {**common, "prompt": f"[{i}] " + _prompt(rng, *cfg.prompt_words)}


def bad_inputs(model: str) -> list[tuple[str, str, object]]:
    """(name, path, raw JSON text or bytes generator factory): issue 17's regression cases."""
    big = b'{"prompt": "' + b"a" * (BAD_BODY_MIB << 20) + b'"}'

    async def chunked():  # no Content-Length: Transfer-Encoding chunked
        for k in range(0, len(big), 1 << 20):
            yield big[k : k + (1 << 20)]

    m = json.dumps(model)
    return [
        (
            "top_k_2_63",
            "/v1/completions",
            f'{{"model": {m}, "prompt": "hi", "max_tokens": 4, "top_k": {2**63}}}',
        ),
        (
            "lone_surrogate_prompt",
            "/v1/completions",
            f'{{"model": {m}, "prompt": "\\ud800 hi", "max_tokens": 4}}',
        ),
        (
            "lone_surrogate_chat",
            "/v1/chat/completions",
            f'{{"model": {m}, "messages": [{{"role": "user", "content": "\\udfff"}}], "max_tokens": 4}}',
        ),
        ("lone_surrogate_model", "/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 4}'),
        (
            "nan_temperature",
            "/v1/completions",
            f'{{"model": {m}, "prompt": "hi", "max_tokens": 4, "temperature": NaN}}',
        ),
        ("float_token_ids", "/v1/completions", f'{{"model": {m}, "prompt": [1.0, 2.0], "max_tokens": 4}}'),
        ("bool_token_ids", "/v1/completions", f'{{"model": {m}, "prompt": [true, false], "max_tokens": 4}}'),
        ("oversized_body", "/v1/completions", big),
        ("oversized_chunked_body", "/v1/completions", chunked),
    ]


def is_openai_error(body) -> bool:
    """{"error": {"message": str, "type": str, "param": ..., "code": ...}}"""
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


# -- one round ---------------------------------------------------------------------------------
@dataclass
class StreamResult:
    kind: str  # "whole", "hung_up", "broken", "http_error", "failed"
    status: int = 0
    latency_s: float | None = None
    ttft_s: float | None = None
    delivered_tokens: int = 0
    problem: str | None = None  # for broken streams and errors
    openai_error_body: bool = True


async def _stream(ac: httpx.AsyncClient, path: str, body: dict, hang_after: int | None) -> StreamResult:
    """One client. hang_after: leave after this many data chunks (None: read to the end)."""
    t0 = time.perf_counter()
    chunks = tokens = 0
    ttft = None
    usage = finish = None
    error_event = None
    try:
        async with ac.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    ok_body = is_openai_error(json.loads(raw))
                except ValueError:
                    ok_body = False
                return StreamResult(
                    "http_error",
                    r.status_code,
                    problem=raw[:200].decode(errors="replace"),
                    openai_error_body=ok_body,
                )
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                if hang_after is not None and chunks >= hang_after:
                    return StreamResult("hung_up", 200, delivered_tokens=tokens)
                chunks += 1
                data = json.loads(line[6:])
                if "error" in data:
                    error_event = data
                    continue
                if data.get("usage"):
                    usage = data["usage"]
                for c in data.get("choices") or ():
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if piece:
                        tokens += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    if c.get("finish_reason"):
                        finish = c["finish_reason"]
    except httpx.HTTPError as e:
        return StreamResult("failed", problem=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - t0
    if hang_after is not None and not done:
        return StreamResult("hung_up", 200, delivered_tokens=tokens)
    delivered = usage["completion_tokens"] if usage else tokens
    problem = None
    if error_event is not None:
        problem = f"error event: {json.dumps(error_event)[:200]}"
    elif not done:
        problem = "no [DONE]"
    elif finish is None:
        problem = "no finish_reason"
    elif usage is None:
        problem = "no usage chunk"
    elif finish == "length" and usage["completion_tokens"] != body["max_tokens"]:
        problem = f"finish length with {usage['completion_tokens']} of {body['max_tokens']} tokens"
    if problem is not None:
        ok_body = error_event is None or is_openai_error(error_event)
        return StreamResult("broken", 200, latency, ttft, delivered, problem, ok_body)
    return StreamResult("whole", 200, latency, ttft, delivered)


async def _bad_then_probe(ac: httpx.AsyncClient, cfg: SoakConfig, rng: random.Random, delay: float) -> dict:
    """The bad inputs, each followed by a normal request, while the round's streams run."""
    await asyncio.sleep(delay)
    out = {"cases": {}, "probe_tokens": 0, "probes_ok": 0, "probes": 0}
    probe = {"model": cfg.model, "prompt": "Hello, my name is", "max_tokens": 2}
    for name, path, payload in bad_inputs(cfg.model):
        content = payload() if callable(payload) else payload
        if isinstance(content, str):
            content = content.encode("utf-8", "surrogatepass")
        t0 = time.perf_counter()
        try:
            r = await ac.post(path, content=content, headers={"content-type": "application/json"})
            status, text = r.status_code, r.text
        except httpx.HTTPError as e:  # a reset connection is a failure too
            status, text = 0, f"{type(e).__name__}: {e}"
        try:
            body_ok = is_openai_error(json.loads(text))
        except ValueError:
            body_ok = False
        took = time.perf_counter() - t0
        ok = 400 <= status < 500 and body_ok
        out["cases"][name] = {"status": status, "openai_body": body_ok, "ok": ok, "seconds": round(took, 3)}
        if not ok:
            out["cases"][name]["body"] = text[:200]
        out["probes"] += 1
        try:
            p = await ac.post("/v1/completions", json=probe)
            if p.status_code == 200:
                out["probes_ok"] += 1
                out["probe_tokens"] += p.json()["usage"]["completion_tokens"]
        except httpx.HTTPError:
            pass
    return out


_METRIC = re.compile(r"^(pagedserve:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+|NaN)$", re.M)


async def read_metrics(ac: httpx.AsyncClient) -> dict[str, float]:
    text = (await ac.get("/metrics")).text
    out: dict[str, float] = {}
    for name, v in _METRIC.findall(text):
        out.setdefault(name.removeprefix("pagedserve:"), float(v))  # first series of each name
    return out


def rss_bytes(pid: int | None) -> dict | None:
    """RSS of the server process and of its children (the engine core), in MB."""
    if pid is None:
        return None
    import psutil

    try:
        p = psutil.Process(pid)
        own = p.memory_info().rss
        kids = 0
        for c in p.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                kids += c.memory_info().rss
    except psutil.Error:
        return None
    return {
        "server_mb": round(own / 2**20, 1),
        "children_mb": round(kids / 2**20, 1),
        "total_mb": round((own + kids) / 2**20, 1),
    }


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]


async def _settle(ac: httpx.AsyncClient, within: float) -> tuple[dict, float]:
    t0 = time.perf_counter()
    while True:
        m = await read_metrics(ac)
        busy = (
            m.get("num_requests_running", 0) or m.get("num_requests_waiting", 0) or m.get("kv_blocks_used", 0)
        )
        if not busy or time.perf_counter() - t0 > within:
            return m, time.perf_counter() - t0
        await asyncio.sleep(0.1)


async def run_round(ac: httpx.AsyncClient, cfg: SoakConfig, index: int) -> dict:
    rng = random.Random(cfg.seed * 1000 + index)
    before = await read_metrics(ac)
    reqs = [_request(cfg, rng, i) for i in range(cfg.streams)]
    hang = [rng.randint(0, body["max_tokens"] - 1) if rng.random() < cfg.hangup else None for _, body in reqs]
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(_stream(ac, path, body, h)) for (path, body), h in zip(reqs, hang)]
    bad = None
    if cfg.bad_inputs:
        bad = asyncio.create_task(_bad_then_probe(ac, cfg, rng, rng.uniform(0.2, 1.0)))
    results: list[StreamResult] = await asyncio.gather(*tasks)
    bad_out = await bad if bad is not None else {"cases": {}, "probe_tokens": 0, "probes_ok": 0, "probes": 0}
    duration = time.perf_counter() - t0
    after, settle_s = await _settle(ac, cfg.settle_s)
    health = (await ac.get("/health")).status_code
    whole = [r for r in results if r.kind == "whole"]
    lat = [r.latency_s for r in whole]
    ttft = [r.ttft_s for r in whole if r.ttft_s is not None]
    p99 = _pct(lat, 0.99)
    generated = after.get("generation_tokens_total", 0) - before.get("generation_tokens_total", 0)
    delivered = sum(r.delivered_tokens for r in results) + bad_out["probe_tokens"]
    statuses = [r.status for r in results] + [c["status"] for c in bad_out["cases"].values()]
    return {
        "round": index + 1,
        "streams": cfg.streams,
        "whole": len(whole),
        "hung_up": sum(r.kind == "hung_up" for r in results),
        "hangups_planned": sum(h is not None for h in hang),
        "broken": [r.problem for r in results if r.kind == "broken"][:10],
        "failed": [r.problem for r in results if r.kind in ("failed", "http_error")][:10],
        "status_5xx": sum(s >= 500 for s in statuses),
        "non_openai_error_bodies": sum(not r.openai_error_body for r in results)
        + sum(not c["openai_body"] for c in bad_out["cases"].values()),
        "bad_inputs": bad_out["cases"],
        "bad_inputs_ok": all(c["ok"] for c in bad_out["cases"].values()),
        "probes_ok": f"{bad_out['probes_ok']}/{bad_out['probes']}",
        "health": health,
        "duration_s": round(duration, 2),
        "settle_s": round(settle_s, 2),
        "running_after": after.get("num_requests_running"),
        "waiting_after": after.get("num_requests_waiting"),
        "leaked_blocks": after.get("kv_blocks_used"),
        "kv_blocks_total": after.get("kv_blocks_total"),
        "kv_audit_failures": after.get("kv_audit_failures_total"),
        "preemptions": after.get("num_preemptions_total"),
        "generated_tokens": int(generated),
        "delivered_tokens": int(delivered),
        "tokens_after_hangup_est": int(max(generated - delivered, 0)),
        "latency_s": {"p50": _r(_pct(lat, 0.5)), "p99": _r(p99), "max": _r(max(lat, default=None))},
        "ttft_s": {"p50": _r(_pct(ttft, 0.5)), "p99": _r(_pct(ttft, 0.99))},
        "slowest_over_p99": _r(max(lat) / p99) if lat and p99 else None,
        "rss": rss_bytes(cfg.pid),
    }


def _dead_round(index: int, why: str) -> dict:
    """A round cut short because the server stopped answering (/metrics or /health)."""
    return {
        "round": index + 1,
        "server_unreachable": why,
        "status_5xx": 0,
        "non_openai_error_bodies": 0,
        "bad_inputs_ok": False,
        "probes_ok": "0/1",
        "broken": [],
        "failed": [why],
        "health": 0,
        "leaked_blocks": None,
        "running_after": None,
        "waiting_after": None,
        "slowest_over_p99": None,
        "rss": None,
    }


def _r(x):
    return None if x is None else round(x, 3)


def verdict(rounds: list[dict], cfg: SoakConfig) -> dict:
    """Pass/fail against issue 17's goals, with the reasons."""
    fails = []
    for r in rounds:
        n = r["round"]
        if r["status_5xx"]:
            fails.append(f"round {n}: {r['status_5xx']} 5xx")
        if r["non_openai_error_bodies"]:
            fails.append(f"round {n}: {r['non_openai_error_bodies']} non-OpenAI error bodies")
        if not r["bad_inputs_ok"]:
            fails.append(f"round {n}: bad inputs not all 4xx with an OpenAI body")
        probes_ok, probes = map(int, r["probes_ok"].split("/"))
        if probes_ok != probes:
            fails.append(f"round {n}: probes answered {r['probes_ok']}")
        if r["broken"] or r["failed"]:
            fails.append(f"round {n}: {len(r['broken'])} broken, {len(r['failed'])} failed streams")
        if r["health"] != 200:
            fails.append(f"round {n}: /health {r['health']}")
        if (r["leaked_blocks"] or 0) > cfg.goals["leaked_blocks"] or r["running_after"] or r["waiting_after"]:
            fails.append(
                f"round {n}: not idle after {cfg.settle_s} s (blocks {r['leaked_blocks']}, running "
                f"{r['running_after']}, waiting {r['waiting_after']})"
            )
        if r.get("kv_audit_failures"):
            fails.append(f"round {n}: {int(r['kv_audit_failures'])} KV accounting audit failures")
        if r["slowest_over_p99"] is not None and r["slowest_over_p99"] > cfg.goals["slowest_over_p99"]:
            fails.append(f"round {n}: slowest stream {r['slowest_over_p99']}x the p99")
    growth = rss_growth(rounds)
    if growth is not None and growth > cfg.goals["rss_growth_after_round2"]:
        fails.append(f"RSS grew {growth:.1%} after round 2")
    return {
        "pass": not fails,
        "failures": fails,
        "rss_growth_after_round2": _r(growth),
        "rss_growth_after_round2_server": _r(rss_growth(rounds, "server_mb")),
        "rss_growth_after_round2_core": _r(rss_growth(rounds, "children_mb")),
    }


def rss_growth(rounds: list[dict], part: str = "total_mb") -> float | None:
    """(RSS after the last round - RSS after round 2) / RSS after round 2 (3+ rounds);
    `part`: total_mb, server_mb (the front end) or children_mb (the engine core)."""
    rss = [r["rss"][part] for r in rounds if r.get("rss")]
    if len(rss) < 3 or not rss[1]:
        return None
    return (rss[-1] - rss[1]) / rss[1]


async def run_soak(cfg: SoakConfig, log=None) -> dict:
    """The whole soak against a running server; returns the report."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.streams + 16, max_keepalive_connections=cfg.streams + 16)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=60)
    rounds = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, timeout=timeout, limits=limits) as ac:
        for i in range(cfg.rounds):
            if cfg.duration_s is not None and i >= 3 and time.perf_counter() - t0 >= cfg.duration_s:
                break
            try:
                r = await run_round(ac, cfg, i)
            except httpx.HTTPError as e:  # the server stopped answering: that is the finding
                rounds.append(_dead_round(i, f"{type(e).__name__}: {e}"))
                break
            rounds.append(r)
            if log is not None:
                log(
                    f"round {r['round']}: {r['whole']} whole, {r['hung_up']} hung up, 5xx {r['status_5xx']}, "
                    f"leaked {r['leaked_blocks']}, after hang-up {r['tokens_after_hangup_est']} tok, "
                    f"p50/p99 {r['latency_s']['p50']}/{r['latency_s']['p99']} s, "
                    f"RSS {(r['rss'] or {}).get('total_mb')} MB, {r['duration_s']} s"
                )
    cfg_out = {k: v for k, v in asdict(cfg).items() if k not in ("api_key", "goals")}
    return {
        "bench": "soak",
        "config": cfg_out,
        "goals": cfg.goals,
        "rounds": rounds,
        "duration_s": round(time.perf_counter() - t0, 1),
        "verdict": verdict(rounds, cfg),
    }


def main(argv: list[str] | None = None) -> None:
    import sys

    ap = argparse.ArgumentParser(
        prog="pagedserve bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--url", default=None, help="a running server (else --launch starts one)")
    ap.add_argument("--model", default=None, help="the model name to send (default: the launched one)")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    ap.add_argument("--api-key", default=None)
    ap.add_argument(
        "--launch", default="default", help="start `pagedserve serve` with this model (default: default)"
    )
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=None, help="seconds: start rounds (up to --rounds, at least 3) until then")
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--hangup", type=float, default=0.3, help="share of clients that leave mid-stream")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--prompt-words", type=int, nargs=2, default=(4, 300), metavar=("MIN", "MAX"))
    ap.add_argument("--settle", type=float, default=30.0, help="seconds the engine may take to go idle")
    ap.add_argument("--no-bad-inputs", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)
    server = None
    url, pid, model = a.url, a.pid, a.model
    if url is None:
        from pagedserve.bench.serve import LocalServer

        t0 = time.perf_counter()
        server = LocalServer(
            a.launch,
            dtype=a.dtype,
            max_num_seqs=a.max_num_seqs,
            max_model_len=a.max_model_len,
            num_kv_blocks=a.num_kv_blocks,
        )
        print(
            f"soak: server up in {time.perf_counter() - t0:.1f} s at {server.url}",
            file=sys.stderr,
            flush=True,
        )
        url, pid, model = server.url, server.proc.pid, "bench"
    if model is None:
        model = httpx.get(
            url + "/v1/models", headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        ).json()["data"][0]["id"]
    cfg = SoakConfig(
        url,
        model,
        a.rounds,
        a.streams,
        a.hangup,
        tuple(a.max_tokens),
        tuple(a.prompt_words),
        a.seed,
        a.settle,
        a.api_key,
        pid,
        not a.no_bad_inputs,
        duration_s=a.duration,
    )
    try:
        report = asyncio.run(run_soak(cfg, log=lambda s: print("soak: " + s, file=sys.stderr, flush=True)))
    finally:
        if server is not None:
            server.stop()
    if server is not None:
        report["server_exit_code"] = server.proc.returncode
    print(json.dumps(report), flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
    if not report["verdict"]["pass"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
