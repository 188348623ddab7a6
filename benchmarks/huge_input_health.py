"""While a 10 MB completion body and a 4 MB chat message are being refused, /health and a short
completion keep answering (issue 17's goal: within 0.5 s). Starts `pagedserve serve default`,
prints one JSON line.

    .venv/bin/python benchmarks/huge_input_health.py [--port 8791]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time

import httpx


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def refuse_while_probing(url: str, model: str, path: str, body: dict) -> dict:
    """Send the huge body from a thread; probe /health and a short completion until it ends."""
    done: dict = {}

    def big() -> None:
        t = time.perf_counter()
        r = httpx.post(url + path, json={"model": model, **body}, timeout=120)
        done.update(seconds=time.perf_counter() - t, status=r.status_code)

    th = threading.Thread(target=big)
    th.start()
    short = {"model": model, "prompt": "hi", "max_tokens": 4}
    health, completion = [], []
    while th.is_alive():
        health.append(timed(lambda: httpx.get(url + "/health", timeout=30)))
        completion.append(timed(lambda: httpx.post(url + "/v1/completions", json=short, timeout=30)))
    th.join()
    return {
        "refused_status": done["status"],
        "refused_s": round(done["seconds"], 2),
        "health_max_s": round(max(health), 3),
        "short_completion_max_s": round(max(completion), 3),
        "probes": len(health),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=8791)
    port = ap.parse_args().port
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [".venv/bin/pagedserve", "serve", "default", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=60)
        cases = {
            "/v1/completions": {"prompt": "hello world " * ((10 << 20) // 12)},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello world " * ((4 << 20) // 12)}]},
        }
        res = {path: refuse_while_probing(url, model, path, body) for path, body in cases.items()}
        print(json.dumps({"bench": "huge_input_vs_health", "model": "default", **res}))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
