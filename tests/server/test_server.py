"""The OpenAI-compatible server, on a free loopback port, with the official client and raw HTTP."""

import asyncio
import json
import re
import socket
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


ENGINE_KW = dict(dtype="float32", num_kv_blocks=400, max_model_len=2048)


class Server:
    """The engine core runs in its own process: tests read it only through HTTP or the
    published stats snapshot, and use a separate offline LLM for reference outputs.
    Served by the same uvicorn server class as `pagedserve serve` (drain on shutdown)."""

    def __init__(
        self,
        model_dir,
        engine_kw=None,
        shutdown_timeout=0.0,
        header_timeout=10.0,
        exit_on_engine_death=False,
        **app_kw,
    ):
        self.async_llm = AsyncLLM.from_engine_args(
            EngineArgs(model=model_dir, **{**ENGINE_KW, **(engine_kw or {})})
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(
            self.async_llm,
            MODEL,
            port=self.port,
            log_level="warning",
            shutdown_timeout=shutdown_timeout,
            header_timeout=header_timeout,
            keep_alive_on_engine_death=not exit_on_engine_death,
            **app_kw,
        )
        self.server = make_server(self.app)
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
        front = metric(url, "pagedserve:num_requests_in_flight", headers)
        assert time.time() - t0 < within, (
            f"still busy after {within} s: running/waiting/blocks={busy}, front end {front}"
        )
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
        ({"prompt": "hi " * 300, "max_tokens": 1900}, None),
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
            # a 504 "request_timeout" is the deadline the generated body itself set (request_timeout)
            asked_deadline = r.status_code == 504 and '"code":"request_timeout"' in r.text
            if r.status_code >= 500 and not asked_deadline:
                failures.append((op.method, op.path, r.status_code, r.text[:200]))

        check()

    for result in schema.get_all_operations():
        check_operation(result.ok())
    assert failures == []
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(server.url, "pagedserve:kv_blocks_used") == 0


# -- issue 19: a client that leaves aborts its requests, whatever the endpoint and shape ----------
LONG = {"max_tokens": 2000, "temperature": 0, "ignore_eos": True}  # seconds even on a quiet machine
CHAT = {"messages": [{"role": "user", "content": "Tell me a long story"}], **LONG}
SHAPES = {
    "completion": ("/v1/completions", {"prompt": "The quick brown fox", **LONG}, 1),
    "completion_list": ("/v1/completions", {"prompt": ["The quick", "A lazy dog", "Paged", "KV"], **LONG}, 4),
    "completion_n4": (
        "/v1/completions",
        {"prompt": "The quick brown fox", **LONG, "n": 4, "temperature": 1},
        4,
    ),
    "chat": ("/v1/chat/completions", CHAT, 1),
    "chat_n4": ("/v1/chat/completions", {**CHAT, "n": 4, "temperature": 1}, 4),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_client_that_leaves_is_aborted_within_a_second(server, shape, stream):
    path, body, seqs = SHAPES[shape]
    before = metric(server.url, "pagedserve:generation_tokens_total")
    body = {"model": MODEL, **body, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # leave mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + path, json=body, timeout=httpx.Timeout(30, read=0.5))
    waited = wait_idle(server.url, within=1.5)  # the goal is 1 s; measured well under it
    print(f"{shape}/{'stream' if stream else 'plain'}: engine idle {waited:.2f} s after the client left")
    # aborted, not run to the end
    assert metric(server.url, "pagedserve:generation_tokens_total") - before < seqs * LONG["max_tokens"]


def test_50_clients_timing_out_mid_generation(server):
    """Goal of issue 19: 0 running requests and 0 KV blocks 2 s after 50 non-streaming
    clients time out mid-generation."""

    async def one(ac, i):
        body = {"model": MODEL, "prompt": f"Client {i}: the quick brown fox", **LONG}
        with pytest.raises(httpx.ReadTimeout):
            await ac.post("/v1/completions", json=body)

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(
            base_url=server.url, timeout=httpx.Timeout(30, read=1.0), limits=limits
        ) as ac:
            await asyncio.gather(*(one(ac, i) for i in range(50)))

    asyncio.run(main())
    waited = wait_idle(server.url, within=2.0)
    print(f"50 clients: engine idle {waited:.2f} s after the last client left")


# -- issue 17: hostile input fails the request that sent it, nothing else --------------------------
def raw_post(url, path, text: str, **kw):
    """A JSON body sent verbatim (NaN literals, lone-surrogate escapes...)."""
    return httpx.post(url + path, content=text.encode(), headers={"content-type": "application/json"}, **kw)


@pytest.mark.parametrize(
    "path,text,param",
    [
        ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "top_p": NaN}', "top_p"),
        ("/v1/completions", '{"prompt": "\\ud800 hi"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt"),
        ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "model"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
    ],
)
def test_non_finite_numbers_and_lone_surrogates_are_400(server, path, text, param):
    r = raw_post(server.url, path, text)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_chunked_body_over_the_limit_is_413(server):
    def body():
        for _ in range(20):  # 20 MiB without a Content-Length
            yield b" " * (1 << 20)

    r = httpx.post(
        server.url + "/v1/completions",
        content=body(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_huge_inputs_are_refused_fast_without_blocking_others(server):
    big = "hello world " * ((10 << 20) // 12)  # ~10 MB
    for path, body in (
        ("/v1/completions", {"prompt": big}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big[: 4 << 20]}]}),
    ):
        t0 = time.perf_counter()
        r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
        took = time.perf_counter() - t0
        print(f"{path}: {len(json.dumps(body)) >> 20} MB input refused in {took:.2f} s")
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
        assert took < 10  # measured well under 1 s; tokenizing it took 5-19 s before


def test_request_chat_templates_are_off_by_default(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_list_prompt_is_aborted_as_a_whole_when_its_client_leaves(server):
    body = {"model": MODEL, "prompt": [f"prompt {i}" for i in range(2000)], **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    t0 = time.time()
    while metric(server.url, "pagedserve:num_requests_in_flight"):  # every element aborted by the front end
        assert time.time() - t0 < 3.0
        time.sleep(0.05)
    aborted = time.time() - t0
    # the engine core then works through 2000 adds and aborts (slow on a loaded 2-core machine).
    # Was an xfail (core stats non-zero for > 15 s); not reproduced in 6 runs at load average
    # ~9 after the fault-isolation work (idle 0.4-2.0 s after the client left), so it is a
    # plain check again.
    waited = wait_idle(server.url, within=15.0)
    print(
        f"2000-prompt list: all aborted by the front end {aborted:.2f} s, engine idle {waited:.2f} s after the client left"
    )


def test_list_prompt_is_as_fast_as_separate_requests(server):
    prompts = [f"prompt number {i}" for i in range(200)]
    params = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", json={**params, "prompt": prompts}, timeout=120)
    as_list = time.perf_counter() - t0
    assert r.status_code == 200 and len(r.json()["choices"]) == 200

    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as ac:
            return await asyncio.gather(
                *(ac.post("/v1/completions", json={**params, "prompt": p}) for p in prompts)
            )

    t0 = time.perf_counter()
    rs = asyncio.run(main())
    separate = time.perf_counter() - t0
    assert all(x.status_code == 200 for x in rs)
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [x.json()["choices"][0]["text"] for x in rs]
    print(f"200 prompts: one list request {as_list:.2f} s, 200 separate requests {separate:.2f} s")
    assert as_list < 2 * separate + 2


def test_a_failing_request_fails_alone(server, monkeypatch):
    ctx = server.app.state.serving

    def boom(*a, **k):
        raise RuntimeError("formatting bug")

    monkeypatch.setattr(ctx.logprobs, "completion", boom)
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 4, "logprobs": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[0]
    monkeypatch.undo()
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    wait_idle(server.url, within=3.0)


def test_a_request_whose_outputs_fail_fails_alone(server, monkeypatch):
    """Issue 17: an exception while detokenizing one request's outputs fails that request
    (a 500 body, or an error event in its stream), the core aborts it (no leaked blocks),
    a concurrent request and a later one complete, and the engine stays up."""
    from pagedserve.engine.detokenizer import IncrementalDetokenizer

    real = IncrementalDetokenizer.add_tokens_until_stop

    def poisoned(self, new_ids):  # only the requests that carry the marker stop string
        if "<boom>" in self.stop:
            raise RuntimeError("detokenizer bug")
        return real(self, new_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens_until_stop", poisoned)
    normal = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }
    bad = {**normal, "prompt": "A lazy dog", "stop": ["<boom>"], "max_tokens": 2000}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:

            async def stream(body):
                async with ac.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    return r.status_code, [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]

            return await asyncio.gather(stream(normal), stream(bad), ac.post("/v1/completions", json=bad))

    (ok_status, ok_lines), (bad_status, bad_lines), bad_plain = asyncio.run(main())
    assert ok_status == 200 and ok_lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in ok_lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert bad_status == 200 and bad_lines[-1] == "data: [DONE]"
    errors = [json.loads(ln[6:]) for ln in bad_lines[:-1] if '"error"' in ln]
    assert errors and errors[0]["error"]["type"] == "server_error"
    assert bad_plain.status_code == 500 and bad_plain.json()["error"]["type"] == "server_error"
    # the engine goes on: health, a request after it, and the failed ones' blocks are freed
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={**normal, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(server.url, within=3.0)
