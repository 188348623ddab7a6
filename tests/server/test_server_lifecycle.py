"""Server lifecycle and admission: shutdown drain (issue 19), --max-queue under a burst
(issue 18), auth, header timeout, bounded error bodies."""

import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedserve.server.admission import AdmissionLimiter  # noqa: E402
from tests.server.test_server import MODEL, Server, free_port, metric, wait_idle  # noqa: E402

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NUM_SEQS = 4
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def guarded(checkpoint):
    """--api-key, --max-queue 8, max_num_seqs 4, a 1 s header timeout, request chat
    templates trusted."""
    # +3 ms a step: the 2-layer model decodes a 2000-token stream in ~2-3 s otherwise, about the
    # drain test's window, and its long streams must still be running when the window ends
    os.environ["PAGEDSERVE_TEST_SLOW_ENGINE"] = "0:0.003"
    try:
        s = Server(
            checkpoint("llama"),
            engine_kw={"max_num_seqs": MAX_NUM_SEQS},
            header_timeout=1.0,
            api_key=KEY,
            max_queue=MAX_QUEUE,
            trust_request_chat_template=True,
        )
    finally:
        del os.environ["PAGEDSERVE_TEST_SLOW_ENGINE"]
    yield s
    s.stop()


def read_sse(lines):
    """data payloads of an SSE stream (the raw lines), and whether it ended with [DONE]."""
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    done = bool(data) and data[-1] == "[DONE]"
    return [json.loads(d) for d in data if d != "[DONE]"], done


# -- auth ---------------------------------------------------------------------------------------
def test_auth_everywhere_but_health(guarded):
    url = guarded.url
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"):
        r = httpx.get(url + path)
        assert r.status_code == 401, path
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert httpx.get(url + path, headers=AUTH).status_code == 200, path
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for value in ("bearer " + KEY, "BEARER " + KEY):  # the scheme is case-insensitive
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": value})
        assert r.status_code == 200, value
    # (a trailing space never reaches the app: HTTP parsers strip it, RFC 9110 5.5)
    for value in (
        "Bearer  " + KEY,
        "Bearer " + KEY + "x",
        "Bearer " + KEY[:-1],
        "Bearer wrong",
        "Basic " + KEY,
        KEY,
        "Bearer",
    ):
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": value})
        assert r.status_code == 401, value


def test_error_bodies_are_bounded(guarded):
    huge = "m" * (1 << 20)
    r = httpx.post(
        guarded.url + "/v1/completions", json={"model": huge, "prompt": "hi"}, headers=AUTH, timeout=30
    )
    assert r.status_code == 404 and len(r.content) < 1024, len(r.content)
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found"
    r = httpx.post(
        guarded.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", huge: 1, "n": huge},
        headers=AUTH,
    )
    assert r.status_code == 400 and len(r.content) < 1024


def test_header_read_timeout(guarded):
    """A client that never finishes its request headers is disconnected (1 s here)."""
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ...and nothing more
        t0 = time.time()
        assert s.recv(1024) == b""  # closed by the server
        assert time.time() - t0 < 5
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
        t0 = time.time()
        assert s.recv(1024) == b""  # connected, sent nothing
        assert time.time() - t0 < 5
    assert httpx.get(guarded.url + "/health").status_code == 200


# -- issue 17: request chat templates (trusted here) run sandboxed, with limits -----------------------
@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",  # 10 GB of output
        "{{ 'x' * 1000000000 }}",  # one 1 GB string
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # 1e10 steps
        "{{ ''.__class__.__mro__ }}",  # sandbox escape attempt
    ],
    ids=["output", "memory", "time", "escape"],
)
def test_trusted_request_chat_template_is_limited(guarded, template):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    t0 = time.perf_counter()
    r = httpx.post(
        guarded.url + "/v1/chat/completions",
        json={**body, "chat_template": template},
        headers=AUTH,
        timeout=60,
    )
    took = time.perf_counter() - t0
    print(f"template {template[:30]!r}: {r.status_code} in {took:.2f} s")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert took < 20
    ok = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    r = httpx.post(guarded.url + "/v1/chat/completions", json={**body, "chat_template": ok}, headers=AUTH)
    assert r.status_code == 200, r.text


# -- issue 18: the --max-queue bound holds under a burst ---------------------------------------------
def test_burst_of_100_with_max_queue_8(guarded):
    """100 requests at once against --max-queue 8 and max_num_seqs 4: at most 12 admitted
    (they would run for a long time: the test leaves them, which aborts them), the rest
    refused at once with 503 + Retry-After; then the server serves normally."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 2000, "ignore_eos": True}
    cap = MAX_QUEUE + MAX_NUM_SEQS

    async def one(ac):
        t0 = time.perf_counter()
        r = await ac.post("/v1/completions", json=body, headers=AUTH)
        return r, time.perf_counter() - t0

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=guarded.url, timeout=120, limits=limits) as ac:
            tasks = [asyncio.create_task(one(ac)) for _ in range(100)]
            deadline = time.time() + 60
            while sum(t.done() for t in tasks) < 100 - cap and time.time() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a straggler refusal would arrive now
            done = [t.result() for t in tasks if t.done()]
            running = [t for t in tasks if not t.done()]
            in_flight = metric(guarded.url, "pagedserve:num_requests_in_flight", AUTH)
            for t in running:
                t.cancel()  # the client leaves: the server aborts them
            await asyncio.gather(*running, return_exceptions=True)
            return done, len(running), in_flight

    done, running, in_flight = asyncio.run(main())
    refused = [(r, t) for r, t in done if r.status_code != 200]
    admitted = running + sum(1 for r, _ in done if r.status_code == 200)
    assert admitted <= cap and in_flight <= cap, (admitted, in_flight)
    assert admitted + len(refused) == 100
    for r, _ in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_overloaded"
    times = sorted(t for _, t in refused)
    print(
        f"burst: {admitted} admitted, {len(refused)} refused; client-side refusal latency "
        f"median {times[len(times) // 2] * 1e3:.1f} ms, max {times[-1] * 1e3:.1f} ms"
    )
    # The goal is 50 ms. Client and server share one process (and GIL) here, on a shared
    # 2-core machine: only a wide bound is asserted; the real figure comes from a separate
    # client process (see the report / BENCHMARKS).
    assert times[-1] < 10.0
    text = httpx.get(guarded.url + "/metrics", headers=AUTH).text
    assert 'pagedserve:request_rejected_total{model_name="tiny",reason="overloaded",status="503"}' in text
    wait_idle(guarded.url, within=5.0, headers=AUTH)
    r = httpx.post(guarded.url + "/v1/completions", json={**body, "max_tokens": 4}, headers=AUTH, timeout=60)
    assert r.status_code == 200
    assert metric(guarded.url, "pagedserve:num_requests_in_flight", AUTH) == 0


def test_list_prompt_elements_count_against_the_bound(guarded):
    cap = MAX_QUEUE + MAX_NUM_SEQS
    body = {"model": MODEL, "prompt": ["x"] * (cap + 1), "max_tokens": 2}
    r = httpx.post(guarded.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 503
    r = httpx.post(
        guarded.url + "/v1/completions", json={**body, "prompt": ["x"] * cap}, headers=AUTH, timeout=60
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == cap


def _hammer(limiter, capacity, rounds, peak):
    for _ in range(rounds):
        if limiter.try_acquire(1):
            with peak.get_lock():
                peak.value = max(peak.value, limiter.in_flight)
            limiter.release(1)


def test_admission_is_atomic_across_threads_and_processes():
    """Check-and-count is one step: threads sharing a limiter, or worker processes sharing
    one through a multiprocessing.Value, never exceed its capacity."""
    ctx = multiprocessing.get_context("fork")
    shared = ctx.Value("q", 0)
    peak = ctx.Value("q", 0)
    limiter = AdmissionLimiter(3, shared=shared)
    procs = [ctx.Process(target=_hammer, args=(limiter, 3, 2000, peak)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert 1 <= peak.value <= 3 and shared.value == 0

    local = AdmissionLimiter(2)
    seen = []

    def worker():
        for _ in range(5000):
            if local.try_acquire(1):
                seen.append(local.in_flight)
                local.release(1)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(seen) <= 2 and local.in_flight == 0


@pytest.mark.slow
def test_sigterm_with_32_long_streams(checkpoint):
    """Goal of issue 19: SIGTERM with 32 long streams in flight: 32/32 end with a final
    chunk and [DONE]; exit 0 within the drain window (default 0) plus 2 s."""
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.frontend.cli", "serve", checkpoint("llama"), "--port", str(port)]
        + [
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "600",
            "--max-model-len",
            "512",
            "--log-level",
            "warning",
        ],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300  # a cold start compiles kernels; CI machines are shared
        while True:
            assert p.poll() is None, p.stdout.read().decode()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.3)

        async def one(ac, i):
            body = {
                "prompt": f"Stream {i}: the quick brown fox",
                "max_tokens": 256,
                "ignore_eos": True,
                "stream": True,
            }
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                lines = [ln async for ln in r.aiter_lines()]
            return read_sse(lines)

        async def main():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as ac:
                tasks = [asyncio.create_task(one(ac, i)) for i in range(32)]
                deadline = time.time() + 120
                while metric(url, "pagedserve:num_requests_running") != 32 and time.time() < deadline:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)
                t0 = time.time()
                p.send_signal(signal.SIGTERM)
                out = await asyncio.gather(*tasks)
                return out, t0, time.time() - t0

        out, t0, streams_ended = asyncio.run(main())
        assert p.wait(30) == 0
        took = time.time() - t0
        ended = sum(
            1 for chunks, done in out if done and chunks and chunks[-1]["choices"][0]["finish_reason"]
        )
        print(
            f"SIGTERM: {ended}/32 streams ended with a final chunk and [DONE] {streams_ended:.2f} s after "
            f"the signal; exit 0 after {took:.2f} s"
        )
        assert ended == 32
        assert streams_ended < 0 + 2 + 1.5  # drain window (0) + 2 s, with slack for a loaded CI machine
        assert took < 0 + 2 + 10  # exit includes stopping the engine core process
    finally:
        if p.poll() is None:
            p.kill()


# -- issue 19: shutdown drains, then ends every request cleanly ------------------------------------
def test_drain_window_then_final_chunks(guarded):
    """Runs last in this module: it shuts the module's server down."""
    s = guarded
    s.server.shutdown_timeout = 1.5
    results = {}

    def stream(name, max_tokens, path="/v1/completions", extra=None):
        body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **(extra or {})}
        if path == "/v1/completions":
            body["prompt"] = f"{name}: the quick brown fox"
        with httpx.stream("POST", s.url + path, json=body, timeout=60, headers=AUTH) as r:
            results[name] = (r.status_code, list(r.iter_lines()))

    def plain(name):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60, headers=AUTH)
        results[name] = (r.status_code, r.json())

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    threads = [threading.Thread(target=stream, args=("short", 8))]  # first: in the running batch of 4
    threads += [threading.Thread(target=stream, args=(f"long{i}", 2000)) for i in range(6)]
    threads += [threading.Thread(target=stream, args=("chat", 2000, "/v1/chat/completions", chat))]
    threads += [threading.Thread(target=plain, args=("plain",))]
    for t in threads:
        t.start()
        time.sleep(0.1)
    time.sleep(1.0)
    t0 = time.time()
    s.server.should_exit = True  # what SIGTERM does
    for t in threads:
        t.join(30)
    ended = time.time() - t0
    s.thread.join(30)
    took = time.time() - t0
    s.async_llm.shutdown()
    print(
        f"drain (window 1.5 s): every client done {ended:.2f} s after the signal, server stopped after {took:.2f} s"
    )
    assert ended < 1.5 + 2.0
    assert took < 1.5 + 2.0 + 8.0  # includes stopping the engine core process (slow on a loaded machine)
    for name, (status, lines) in results.items():
        if name == "plain":
            assert status == 503 and lines["error"]["code"] == "shutting_down"
            continue
        assert status == 200
        chunks, done = read_sse(lines)
        assert done, name
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] in ("length", "abort"), (name, reasons[-3:])
    assert read_sse(results["short"][1])[0][-1]["choices"][0]["finish_reason"] == "length"
    assert read_sse(results["long0"][1])[0][-1]["choices"][0]["finish_reason"] == "abort"


# -- issue 17: a dead engine is visible, and the server exits for its supervisor -------------------
STREAM_BODY = {"model": MODEL, "prompt": "The quick", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def stream_then(s, act) -> list:
    """A long streamed completion on server `s`; `act()` runs once 4 lines have arrived;
    the stream's chunks (and whether [DONE] came) once it ends."""
    with httpx.stream("POST", s.url + "/v1/completions", json=STREAM_BODY, timeout=30) as r:
        lines = []
        for ln in r.iter_lines():
            lines.append(ln)
            if len(lines) == 4:
                act()
    return read_sse(lines)


@pytest.mark.parametrize("keep_alive", [False, True], ids=["exits", "keep_alive"])
def test_engine_death_is_visible_and_exits_the_server(checkpoint, keep_alive):
    """An executor fault (here: the core process killed) fails in-flight requests with a
    503 body; by default the server then stops (`pagedserve serve` exits 1, for systemd or
    k8s to restart it); with --keep-alive-on-engine-death it keeps answering 503."""
    s = Server(checkpoint("llama"), exit_on_engine_death=not keep_alive)
    try:
        chunks, done = stream_then(s, lambda: os.kill(s.async_llm.handle.process.pid, signal.SIGKILL))
        assert done and any("error" in c and c["error"]["code"] == "engine_dead" for c in chunks)
        if keep_alive:
            assert httpx.get(s.url + "/health").status_code == 503
            r = httpx.post(s.url + "/v1/completions", json={**STREAM_BODY, "stream": False}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert s.thread.is_alive()
        else:
            s.thread.join(10)
            assert not s.thread.is_alive() and s.server.engine_died
    finally:
        s.stop()


def test_a_shutdown_for_an_engine_fault_tells_open_streams_its_code(checkpoint):
    """The server's exit after an engine fault drains the requests still open with the fault's
    code (engine_dead), not as a plain shutdown (which sends no error event): whichever of the
    fault and the drain reaches a stream first, the client reads the same error. Here the drain
    comes first by construction (the engine is alive, the server told it died)."""
    s = Server(checkpoint("llama"), exit_on_engine_death=True)

    def fault():  # what on_tick does when it finds the engine dead
        s.server.fault_code, s.server.should_exit = "engine_dead", True

    try:
        chunks, done = stream_then(s, fault)
        assert done and any("error" in c and c["error"]["code"] == "engine_dead" for c in chunks)
        assert any(c.get("choices") and c["choices"][0]["finish_reason"] == "abort" for c in chunks)
    finally:
        s.stop()


def test_a_request_during_a_fault_drain_gets_the_fault_code(checkpoint):
    """A request admitted while the server drains for an engine fault is refused with the
    fault's code (engine_dead / engine_stalled), not a plain shutdown's: the client is told
    why, whichever of the fault and the drain it meets first (a race a CI run once hit:
    'shutting_down' right after the core was killed). A plain drain still says shutting_down."""
    from pagedserve.server.http_errors import APIError

    s = Server(checkpoint("llama"), exit_on_engine_death=True)
    serving = s.server.serving
    try:
        for error, code in ((("server_error", "engine_dead", 503), "engine_dead"), (None, "shutting_down")):
            asyncio.run(serving.drain(0.0, error=error))  # no request open: returns at once
            with pytest.raises(APIError) as e:
                serving.admit(1, {})
            assert e.value.status == 503 and e.value.code == code
    finally:
        serving.draining, serving.drain_fault = False, None
        s.stop()
