"""The fault suite (issue 31), short: `pagedserve serve` as a supervisor sees it. The core
SIGKILLed while idle, SIGSTOPped mid-stream (a stall), a tensor-parallel worker killed
while idle, the server SIGKILLed (no orphans), a body sent at a byte per second, a
request past its deadline. Each with the outcome it must have."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

pytest.importorskip("fastapi")

from tests.server.test_server import free_port, metric, wait_idle  # noqa: E402

BASE = ["--dtype", "float32", "--num-kv-blocks", "300", "--max-model-len", "512", "--log-level", "warning"]


class Serve:
    """`pagedserve serve` in a child process, the way a supervisor runs it."""

    def __init__(self, model, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "pagedserve.frontend.cli", "serve", model, "--port", str(self.port), *BASE, *flags]
        self.proc = subprocess.Popen(argv, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.2)

    def core(self) -> psutil.Process:
        """The engine-core process (the server's child that is not multiprocessing's tracker)."""
        kids = [p for p in psutil.Process(self.proc.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(kids) == 1, kids
        return kids[0]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("llama")


def down(url: str) -> bool:
    """/health says 503, or the server already exited (it does so on an engine death)."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 503
    except httpx.TransportError:  # refused or reset: the server is exiting or gone
        return True


def until(cond, within: float, step: float = 0.02) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within, f"not within {within} s"
        time.sleep(step)
    return time.monotonic() - t0


def test_core_killed_while_idle_is_seen_at_once_and_the_server_exits_1(model):
    s = Serve(model)
    try:
        core = s.core()
        core.kill()
        t_health = until(lambda: down(s.url), within=1.0)
        t0 = time.monotonic()
        try:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        except httpx.TransportError:
            pass  # the server already exited: a refused or reset connection is an answer too
        assert time.monotonic() - t0 < 2
        assert s.proc.wait(5) == 1
        assert t_health < 1.0
    finally:
        s.stop()


def test_a_stalled_core_turns_health_503_and_recovers(model):
    s = Serve(model, "--stall-timeout", "1.5")
    try:
        core = s.core()
        done = {}

        def stream():
            body = {"prompt": "stall", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            done["lines"] = lines

        t = threading.Thread(target=stream)
        t.start()
        until(lambda: metric(s.url, "pagedserve:num_requests_running") == 1, within=20)
        core.suspend()  # SIGSTOP: alive, making no progress
        t_stop = time.monotonic()
        until(lambda: httpx.get(s.url + "/health", timeout=2).status_code == 503, within=4.0, step=0.1)
        assert time.monotonic() - t_stop < 1.5 + 1.5  # the stall timeout + 1 s (and polling)
        health = httpx.get(s.url + "/health", timeout=2).json()
        assert health["error"]["code"] == "engine_stalled"
        assert metric(s.url, "pagedserve:engine_stalled") == 1
        core.resume()
        until(lambda: httpx.get(s.url + "/health", timeout=2).status_code == 200, within=10)
        t.join(60)
        assert done["lines"][-1] == "data: [DONE]"
        assert metric(s.url, "pagedserve:engine_stalled") == 0
    finally:
        s.stop()


def test_long_prefill_chunks_are_no_stall(model):
    """Whole-prompt chunks of 2,000 tokens between short decodes, watched with a short
    stall timeout: no false alarm (the adaptation itself: tests/engine/test_stall.py)."""
    s = Serve(model, "--stall-timeout", "2", "--max-model-len", "2048", "--max-num-batched-tokens", "2048")
    try:
        httpx.post(s.url + "/v1/completions", json={"prompt": "warm", "max_tokens": 8}, timeout=60)
        seen_503 = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen_503.append(httpx.get(s.url + "/health", timeout=5).status_code == 503)
                time.sleep(0.1)

        w = threading.Thread(target=watch)
        w.start()
        for k in range(3):
            prompt = [5 + (i * (k + 3)) % 900 for i in range(2000)]
            r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=120)
            assert r.status_code == 200
        stop.set()
        w.join()
        assert seen_503 and not any(seen_503)
    finally:
        s.stop()


def test_server_killed_leaves_no_orphan(model):
    s = Serve(model)
    core = s.core()
    s.proc.kill()
    s.proc.wait(10)
    until(lambda: not core.is_running() or core.status() == psutil.STATUS_ZOMBIE, within=5)


def test_tensor_parallel_worker_killed_while_idle(checkpoint):
    s = Serve(checkpoint("llama_tp"), "--tensor-parallel-size", "2")
    try:
        workers = [p for p in s.core().children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(workers) == 2
        workers[1].kill()
        until(lambda: down(s.url), within=3.0)
        assert s.proc.wait(10) == 1
    finally:
        s.stop()


def test_a_body_sent_a_byte_a_second_gets_408_and_a_deadline_gets_504(model):
    s = Serve(model, "--body-timeout", "1.5")
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n")
            t0 = time.monotonic()
            reply = b""
            for ch in b'{"prompt": "slow':
                c.sendall(bytes([ch]))
                time.sleep(0.3)
                c.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    reply += c.recv(4096)
                c.setblocking(True)
                if reply:
                    break
            if not reply:
                reply = c.recv(4096)
            assert b" 408 " in reply.split(b"\r\n")[0] and b"body_timeout" in reply
            assert time.monotonic() - t0 < 1.5 + 1.0
        assert httpx.get(s.url + "/health").status_code == 200
        body = {"prompt": "long", "max_tokens": 480, "ignore_eos": True, "request_timeout": 0.02}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
        wait_idle(s.url, within=5)  # its blocks are back
        assert metric(s.url, "pagedserve:request_timeouts_total") == 1
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert any(e.get("error", {}).get("code") == "request_timeout" for e in events)
    finally:
        s.stop()
