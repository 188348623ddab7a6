"""The server's edge, piece by piece (no engine): the guard's checks, body reading, the
disconnect watcher, error mapping and shapes, response pieces, admission."""

import asyncio
import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedserve.errors import EngineDeadError, InvalidRequestError
from pagedserve.server.admission import AdmissionLimiter
from pagedserve.server.http_errors import APIError, install_error_handlers, quote, safe_message, to_api_error
from pagedserve.server.middleware import (
    BodyTooLarge,
    RequestGuard,
    authorized,
    content_length,
    read_body,
    run_watched,
)
from pagedserve.server.responses import MIN_LOGPROB, SSE_DONE, envelope, finite_logprob, sse, usage
from pagedserve.server.serving_base import CLEANUP_KEY


def scope(headers=(), path="/v1/completions"):
    return {"type": "http", "path": path, "headers": [(k.encode(), v.encode()) for k, v in headers]}


def test_authorized_needs_the_bearer_scheme_and_the_exact_key():
    assert authorized(scope([("authorization", "Bearer k1")]), b"k1")
    assert authorized(scope([("authorization", "bearer k1")]), b"k1")
    assert not authorized(scope([("authorization", "Bearer k2")]), b"k1")
    assert not authorized(scope([("authorization", "Basic k1")]), b"k1")
    assert not authorized(scope([("authorization", "Bearerk1")]), b"k1")
    assert not authorized(scope(), b"k1")


def test_content_length():
    assert content_length(scope([("content-length", "12")])) == 12
    assert content_length(scope([("content-length", "-3")])) == "bad"
    assert content_length(scope()) is None


def messages(*chunks, disconnect=False):
    items = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    if disconnect:
        items = items[:-1] + [{"type": "http.disconnect"}]
    it = iter(items)

    async def receive():
        return next(it)

    return receive


def test_read_body_joins_chunks_bounds_them_and_sees_a_client_leave():
    assert asyncio.run(read_body(messages(b"ab", b"cd", b"e"), 10)) == b"abcde"
    assert asyncio.run(read_body(messages(b"ab", b"cd", disconnect=True), 10)) is None
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(messages(b"abcdef", b"ghijkl"), 10))


def test_a_client_that_leaves_cancels_the_handler_and_cleanups_run():
    cancelled, cleaned = asyncio.Event(), []

    async def app(sc, receive, send):
        assert (await receive())["body"] == b"{}"
        sc[CLEANUP_KEY].append(lambda: cleaned.append(1))
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        left = asyncio.Event()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(_):
            pass

        task = asyncio.create_task(run_watched(app, {"type": "http"}, receive, send, b"{}"))
        await asyncio.sleep(0.05)
        left.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert cancelled.is_set() and cleaned == [1]


def guarded_app(**kw):
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body.get("raise") == "invalid":
            raise InvalidRequestError("temperature must be >= 0", "temperature")
        if body.get("raise") == "dead":
            raise EngineDeadError("gone")
        if body.get("raise") == "bug":
            raise KeyError("a bug")
        return {"ok": True}

    app.add_middleware(RequestGuard, **kw)
    return TestClient(app, raise_server_exceptions=False)


def test_the_guard_answers_in_openais_shape():
    rejected = []
    c = guarded_app(api_key="k", max_body_bytes=100, on_reject=rejected.append)
    r = c.post("/v1/completions", json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    ok = {"Authorization": "Bearer k"}
    assert c.post("/v1/completions", json={}, headers=ok).json() == {"ok": True}
    r = c.post("/v1/completions", content=b"x" * 200, headers={**ok, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert rejected == ["unauthorized", "body_too_large"]
    assert c.get("/health").status_code == 404  # open path: no 401, then the router's 404
    assert c.get("/health").json()["error"]["type"] == "not_found_error"


async def ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def asgi_call(guard, body_arrives: asyncio.Event | None = None):
    """One POST through `guard`; its body comes a moment after the headers (or once
    `body_arrives` is set), as a client's separate writes do. Returns the status."""
    sent, calls = [], 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls > 1:  # the disconnect watcher: the client stays
            await asyncio.Event().wait()
        await (body_arrives.wait() if body_arrives else asyncio.sleep(0.001))
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg):
        sent.append(msg)

    async def call():
        await guard(scope(), receive, send)
        return sent[0]["status"]

    return call()


def test_a_burst_of_requests_waits_for_body_slots_instead_of_503():
    """512 requests at once whose bodies all arrive within a millisecond, against 4 slots:
    every one is read (they had got 503s: 164 of 512 in a GPU serving benchmark)."""
    rejected = []
    guard = RequestGuard(ok_app, max_pending_bodies=4, on_reject=rejected.append)

    async def burst():
        return await asyncio.gather(*(asyncio.create_task(asgi_call(guard)) for _ in range(512)))

    assert asyncio.run(burst()) == [200] * 512 and rejected == [] and guard.pending_bodies == 0


def test_bodies_that_never_come_hold_the_slots_and_the_next_request_gets_503():
    rejected = []
    guard = RequestGuard(ok_app, max_pending_bodies=2, slot_wait=0.05, on_reject=rejected.append)

    async def run():
        stuck = asyncio.Event()
        slow = [asyncio.create_task(asgi_call(guard, stuck)) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert guard.pending_bodies == 2
        refused = await asgi_call(guard)  # waited slot_wait, then refused
        stuck.set()  # the slow bodies arrive: their slots free
        return refused, await asyncio.gather(*slow), await asgi_call(guard)

    refused, slow, after = asyncio.run(run())
    assert (refused, slow, after) == (503, [200, 200], 200) and rejected == ["too_many_bodies"]
    assert guard.pending_bodies == 0


def test_error_mapping_names_the_param_and_never_500s_bad_input():
    c = guarded_app()
    r = c.post("/v1/completions", json={"raise": "invalid"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body is not valid JSON"
    r = c.post("/v1/completions", json={"raise": "dead"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = c.post("/v1/completions", json={"raise": "bug"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal server error"
    assert to_api_error(ValueError("x")).status == 400
    assert to_api_error(RuntimeError("x")).status == 500
    e = APIError(404, "no", "not_found_error", "model", "model_not_found")
    assert e.body() == {"error": {"message": "no", "type": "not_found_error", "param": "model", "code": "model_not_found"}}


def test_messages_quote_and_bound_user_input():
    assert quote("x" * 100).endswith("...'") and len(quote("x" * 100)) < 80
    assert quote("\ud800") == repr("\\ud800")  # an unpaired surrogate stays encodable
    assert len(safe_message("y" * 5000)) == 1027
    safe_message("\udcff").encode("utf-8")


def test_response_pieces():
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    env = envelope("id1", "text_completion", 5, "m", [], usage(1, 1))
    assert env["id"] == "id1" and env["usage"]["total_tokens"] == 2
    assert "usage" not in envelope("id1", "text_completion", 5, "m", [])
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n' and SSE_DONE == "data: [DONE]\n\n"
    # text with characters str.splitlines breaks at (httpx's iter_lines does): still one line
    text = "a\x85b\u2028c\u2029d\ne\r"
    line = sse({"t": text})
    assert line.splitlines() == [line[:-2], ""] and line.endswith("\n\n")
    assert json.loads(line[len("data: ") :]) == {"t": text}
    assert finite_logprob(float("-inf")) == MIN_LOGPROB and finite_logprob(-1.5) == -1.5 and finite_logprob(None) is None


def test_admission_limiter_bounds_in_flight_requests():
    lim = AdmissionLimiter(3)
    assert lim.try_acquire(2) and not lim.try_acquire(2) and lim.try_acquire(1)
    assert lim.in_flight == 3
    lim.release(2)
    assert lim.in_flight == 1 and lim.try_acquire(2)
    unbounded = AdmissionLimiter(None)
    assert all(unbounded.try_acquire(100) for _ in range(10))


def test_request_chat_templates_render_sandboxed_and_errors_name_the_param():
    from pagedserve.server.chat_template import render_request_template

    msgs = [{"role": "user", "content": "hi"}]
    tmpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    assert asyncio.run(render_request_template(tmpl, msgs, True, {})) == "<user>hi<a>"
    with pytest.raises(InvalidRequestError, match="no system role") as e:
        asyncio.run(render_request_template("{{ raise_exception('no system role') }}", msgs, True, {}))
    assert e.value.param == "chat_template"
    with pytest.raises(InvalidRequestError, match="chat template") as e:  # the sandbox refuses attribute tricks
        asyncio.run(render_request_template("{{ ''.__class__.__mro__ }}", msgs, True, {}))


def test_request_template_timeout_when_the_child_died_of_its_cpu_limit_meanwhile(monkeypatch):
    """The wall-clock timeout and the child's CPU limit are the same seconds: when the child
    exits of its limit just as the timeout fires, killing it raises ProcessLookupError. The
    answer must still be the timeout's 400 naming chat_template (it once surfaced as an
    empty-message error naming messages)."""
    from pagedserve.server import chat_template

    class ExitedChild:
        returncode = -9

        async def communicate(self, payload):
            await asyncio.sleep(10)

        def kill(self):
            raise ProcessLookupError

        async def wait(self):
            return self.returncode

    async def spawn(*args, **kwargs):
        return ExitedChild()

    monkeypatch.setattr(chat_template.asyncio, "create_subprocess_exec", spawn)
    with pytest.raises(InvalidRequestError, match="longer than") as e:
        asyncio.run(chat_template.render_request_template("x", [], True, {}, timeout=0.05))
    assert e.value.param == "chat_template"


def test_server_flags_come_from_server_config():
    import argparse
    import dataclasses

    from pagedserve.server.server_config import ServerConfig

    p = argparse.ArgumentParser()
    ServerConfig.add_cli_args(p)
    ns = p.parse_args([])
    assert ServerConfig.from_cli_args(ns) == ServerConfig()  # every default from the dataclass
    ns = p.parse_args(["--port", "9", "--max-body-bytes", "1MiB", "--stall-action", "exit", "--request-timeout", "2.5",
                       "--default-slo", '{"ttft_ms": 500}', "--keep-alive-on-engine-death"])
    cfg = ServerConfig.from_cli_args(ns)
    assert (cfg.port, cfg.max_body_bytes, cfg.stall_action, cfg.request_timeout) == (9, 1 << 20, "exit", 2.5)
    assert cfg.default_slo == {"ttft_ms": 500} and cfg.keep_alive_on_engine_death
    with pytest.raises(SystemExit):
        p.parse_args(["--stall-action", "panic"])
    assert all(f.metadata["help"] for f in dataclasses.fields(ServerConfig))
