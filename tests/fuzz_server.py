"""Long fuzzing run of the server with schemathesis (issue 17), not part of the test suite.

    nice .venv/bin/python -m tests.fuzz_server --minutes 10 [--max-model-len 128] [--output-json F]

Starts the server (tiny random checkpoint, engine core in its own process, a small
max_model_len so that every generated request is short) and sends property-based requests
generated from its own OpenAPI schema, every operation in turn, batches of --batch examples
each, until the time is up. Counts requests, status classes, 5xx (with the bodies), 4xx
answers without an OpenAI error body, and checks after every batch that /health is 200 and
a normal completion is answered. Prints a JSON report; exit status 1 on any 5xx.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time

import httpx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=100, help="examples per operation before moving on")
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)

    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings

    from tests.checkpoints import build_checkpoint
    from tests.server.test_server import Server

    model_dir = build_checkpoint(tempfile.mkdtemp(prefix="fuzz-"), "llama")
    srv = Server(model_dir, engine_kw={"max_model_len": a.max_model_len})
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    counts: collections.Counter = collections.Counter()
    per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    server_errors, bad_bodies, probe_failures = [], [], []
    deadline = time.time() + a.minutes * 60
    t0 = time.time()

    def run_batch(op, batch_seed: int) -> None:
        name = f"{op.method.upper()} {op.path}"

        @seed(batch_seed)
        @given(case=op.as_strategy())
        @settings(max_examples=a.batch, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            if time.time() > deadline:
                return
            try:
                r = case.call(base_url=srv.url, timeout=60)
            except Exception as e:  # noqa: BLE001 (a reset connection is a finding too)
                counts["transport_error"] += 1
                server_errors.append((name, "transport", repr(e)[:300], _body(case)))
                return
            counts["requests"] += 1
            per_op[name][r.status_code // 100 * 100] += 1
            counts[f"{r.status_code // 100}xx"] += 1
            if r.status_code >= 500:
                server_errors.append((name, r.status_code, r.text[:300], _body(case)))
            elif r.status_code >= 400 and op.path.startswith("/v1/"):
                try:
                    err = r.json().get("error")
                    ok = isinstance(err, dict) and isinstance(err.get("message"), str)
                except (ValueError, AttributeError):
                    ok = False
                if not ok:
                    bad_bodies.append((name, r.status_code, r.text[:300], _body(case)))

        check()

    i = 0
    while time.time() < deadline:
        for op in ops:
            if time.time() >= deadline:
                break
            run_batch(op, a.seed * 100003 + i)
            i += 1
            ok_health = httpx.get(srv.url + "/health", timeout=30).status_code == 200
            probe = httpx.post(
                srv.url + "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                timeout=60,
            )
            counts["probes"] += 1
            if not ok_health or probe.status_code != 200:
                probe_failures.append((op.path, probe.status_code, probe.text[:200]))
        print(f"fuzz: {time.time() - t0:.0f} s, {dict(counts)}", file=sys.stderr, flush=True)
    alive = srv.async_llm.is_alive
    srv.stop()
    report = {
        "minutes": a.minutes,
        "max_model_len": a.max_model_len,
        "batch": a.batch,
        "batches": i,
        "counts": dict(counts),
        "per_operation": {k: dict(v) for k, v in per_op.items()},
        "server_errors": server_errors[:50],
        "num_server_errors": len(server_errors),
        "non_openai_4xx_bodies": bad_bodies[:20],
        "num_non_openai_4xx_bodies": len(bad_bodies),
        "probe_failures": probe_failures[:20],
        "engine_alive_at_end": alive,
    }
    print(json.dumps(report, default=str))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if server_errors or probe_failures or not alive else 0


def _body(case) -> str:
    try:
        return json.dumps(case.body, default=str)[:300]
    except Exception:  # noqa: BLE001
        return repr(case.body)[:300]


if __name__ == "__main__":
    sys.exit(main())
