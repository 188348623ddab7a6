"""A 4,000-token prefill chunk on the default model, /health polled every 100 ms: no 503
(issue 31; BENCHMARKS.md section 28). Run from the checkout:

    .venv/bin/python benchmarks/stall_prefill_check.py
"""

import json
import os
import random
import subprocess
import threading
import time

import httpx

PORT = 8771
URL = f"http://127.0.0.1:{PORT}"
EXE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".venv", "bin", "pagedserve")


def wait_up() -> None:
    for _ in range(600):
        try:
            if httpx.get(URL + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def main() -> None:
    cmd = [EXE, "serve", "--port", str(PORT), "--max-num-batched-tokens", "4096", "--max-model-len", "8192",
           "--served-model-name", "m"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_up()
        httpx.post(URL + "/v1/completions", json={"model": "m", "prompt": "warm up", "max_tokens": 4}, timeout=120)
        codes, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                codes.append(httpx.get(URL + "/health", timeout=10).status_code)
                time.sleep(0.1)

        t = threading.Thread(target=watch)
        t.start()
        times = []
        for seed in range(3):
            rng = random.Random(seed)
            prompt = [rng.randrange(100, 49000) for _ in range(4000)]
            t0 = time.perf_counter()
            r = httpx.post(URL + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}, timeout=300)
            times.append(round(time.perf_counter() - t0, 2))
            assert r.status_code == 200, r.text
        stop.set()
        t.join()
        print(json.dumps({"check": "4000-token prefill chunk, default --stall-timeout", "prefill_s": times,
                          "health_polls": len(codes), "health_503": codes.count(503),
                          "other": [c for c in codes if c not in (200, 503)]}))
    finally:
        p.terminate()
        p.wait(30)


if __name__ == "__main__":
    main()
