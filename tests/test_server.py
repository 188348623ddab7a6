"""The OpenAI-compatible server, on a free loopback port, with the official client and raw HTTP."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.async_engine import AsyncLLM  # noqa: E402
from pagedserve.engine_args import EngineArgs  # noqa: E402
from pagedserve.server.api_server import build_app, make_server  # noqa: E402

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENGINE_KW = dict(dtype="float32", num_kv_blocks=400, max_model_len=512)


class Server:
    """The engine core runs in its own process: tests read it only through HTTP or the
    published stats snapshot, and use a separate offline LLM for reference outputs.
    Served by the same uvicorn server class as `pagedserve serve` (drain on shutdown)."""

    def __init__(self, model_dir, engine_kw=None, shutdown_timeout=0.0, header_timeout=10.0, **app_kw):
        self.async_llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **{**ENGINE_KW, **(engine_kw or {})}))
        self.app = build_app(self.async_llm, MODEL, **app_kw)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(
            self.app,
            port=self.port,
            log_level="warning",
            shutdown_timeout=shutdown_timeout,
            header_timeout=header_timeout,
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            assert self.thread.is_alive(), "server thread died"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.async_llm.shutdown()


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(checkpoint("llama"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(checkpoint):
    """A separate engine with the server's settings, for reference outputs."""
    return LLM(checkpoint("llama"), **ENGINE_KW)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def metric(url, name, headers=None):
    text = httpx.get(url + "/metrics", headers=headers).text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def wait_idle(url, within: float, headers=None) -> float:
    """Seconds until the engine holds no request and no KV block (fails after `within`)."""
    t0 = time.time()
    while True:
        busy = [
            metric(url, f"pagedserve:{n}", headers)
            for n in ("num_requests_running", "num_requests_waiting", "kv_blocks_used")
        ]
        if not any(busy):
            return time.time() - t0
        assert time.time() - t0 < within, f"still busy after {within} s: running/waiting/blocks={busy}"
        time.sleep(0.05)


def test_models_health_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_blocks_used",
        "kv_blocks_total",
        "kv_utilization",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert f"pagedserve:{name}" in text, name


def test_completion_matches_offline_and_stream_equals_non_stream(server, client, offline):
    prompt = "The quick brown fox"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    ref = offline.generate(
        prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert r.choices[0].text == ref[0].outputs[0].text
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(ref[0].prompt_token_ids)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_stream_and_n(client):
    msgs = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    )
    r2 = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in r2.choices) == [0, 1]
    r3 = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, n=2, temperature=1.0, seed=1)
    assert sorted(c.index for c in r3.choices) == [0, 1]


def test_logprobs_and_echo_for_loglikelihood(client, offline):
    r = client.completions.create(model=MODEL, prompt="The quick", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) == 3 for t in lp.top_logprobs)
    # echo + max_tokens=0: the prompt's own logprobs (what lm-eval's local-completions reads)
    e = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    c = e.choices[0]
    assert c.text == "The quick brown fox"
    n = len(offline.get_tokenizer().encode("The quick brown fox"))
    assert len(c.logprobs.tokens) == n and c.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in c.logprobs.token_logprobs[1:])
    ch = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    content = ch.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "top_k": 9223372036854775808}, "top_k"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "seed": 2**64}, "seed"),
        ({"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"prompt": "hi", "n": True}, "n"),
        ({"prompt": [1.0, 2.0]}, "prompt"),
        ({"prompt": [True, 2]}, "prompt"),
        ({"prompt": [[1, 2], [3.5]]}, "prompt"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "n": 1000}, "n"),
        ({"prompt": "hi " * 300, "max_tokens": 400}, None),
        ({"prompt": [1, 2, 999999]}, ("prompt", "prompt_token_ids")),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({}, "prompt"),
    ],
)
def test_invalid_completion_requests_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if isinstance(param, tuple):
        assert err["param"] in param, err
    elif param:
        assert err["param"] == param, err
    assert err["code"] is None or isinstance(err["code"], str)
    assert httpx.get(server.url + "/health").status_code == 200  # the engine survived


def test_malformed_json_unknown_model_oversize(server):
    r = httpx.post(
        server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"x" * (17 << 20),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": "hello"})
    assert r.status_code == 400
    assert metric(server.url, "pagedserve:kv_blocks_used") == 0


def test_disconnect_mid_stream_frees_blocks(server):
    before = metric(server.url, "pagedserve:generation_tokens_total")
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break  # leave mid-stream
    deadline = time.time() + 10
    while metric(server.url, "pagedserve:kv_blocks_used") != 0 or metric(
        server.url, "pagedserve:num_requests_running"
    ):
        assert time.time() < deadline, "blocks were not freed after the client left"
        time.sleep(0.05)
    # the request was aborted, not run to its 500 tokens
    assert metric(server.url, "pagedserve:generation_tokens_total") - before < 500


def test_32_concurrent_streams_match_offline(server, offline):
    prompts = [f"Request number {i}: the quick brown fox" for i in range(32)]
    refs = offline.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False
    )

    async def one(ac, p):
        text = ""
        async with ac.stream(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": p,
                "max_tokens": 16,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as r:
            assert r.status_code == 200
            lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for ln in lines[:-1]:
            text += json.loads(ln[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == [r.outputs[0].text for r in refs]


@pytest.mark.slow
def test_sigterm_exits_cleanly(checkpoint):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedserve.frontend.cli",
            "serve",
            checkpoint("llama"),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "100",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 120
        while True:
            assert p.poll() is None, p.stdout.read().decode()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_schemathesis_finds_no_server_errors(server):
    """Property-based requests generated from the server's own OpenAPI schema: never a 5xx,
    and the engine stays alive (this found an unbounded prompt_logprobs crashing the engine)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures = []

    def check_operation(op):
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            r = case.call(base_url=server.url, timeout=60)
            if r.status_code >= 500:
                failures.append((op.method, op.path, r.status_code, r.text[:200]))

        check()

    for result in schema.get_all_operations():
        check_operation(result.ok())
    assert failures == []
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(server.url, "pagedserve:kv_blocks_used") == 0

