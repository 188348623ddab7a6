"""The OpenAI endpoints over a fake engine (no model): /v1/completions streamed and not,
/v1/models, /health, /tokenize, /detokenize, through the real app (build_app) with
FastAPI's test client. What the fake cannot show (real tokens) the server tests do."""

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pagedserve.config import EngineConfig, SchedulerConfig
from pagedserve.messages import EngineStats
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind
from pagedserve.server.api_server import build_app
from pagedserve.server.dashboard import add_dashboard
from pagedserve.server.serving_completion import OpenAIServingCompletion
from pagedserve.server.serving_models import OpenAIServingModels
from pagedserve.server.serving_tokenize import OpenAIServingTokenization

WORDS = [" sunny", " and", " warm"]


class FakeStream:
    """Three outputs of one word each, the last one finished."""

    def __init__(self, llm, rid, tokenizer, params):
        self.llm, self.rid, self.tok, self.i, self.closed = llm, rid, tokenizer, 0, False
        self.delta = params.output_kind == RequestOutputKind.DELTA

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.i == len(WORDS):
            raise StopAsyncIteration
        self.i += 1
        words = WORDS[self.i - 1 : self.i] if self.delta else WORDS[: self.i]
        ids = [t for w in words for t in self.tok.encode(w)]
        done = self.i == len(WORDS)
        c = CompletionOutput(0, "".join(words), ids, finish_reason="length" if done else None)
        return RequestOutput(self.rid, "p", [1, 2], [c], finished=done)

    def close(self):
        self.closed = True
        self.llm.closed.append(self.rid)


class FakeLLM:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.config = EngineConfig(scheduler=SchedulerConfig(max_model_len=128))
        self.is_alive = True
        self.snapshot = None
        self.closed: list[str] = []
        self.feeds: list[asyncio.Task] = []
        self.stats = EngineStats(0, 0, 10, 0, 0.0, 1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16)

    async def add_request(self, prompt, params, rid, priority=0, queue=None):
        st = FakeStream(self, rid, self.tokenizer, params)
        if queue is not None:  # as the engine's output loop: every output into the caller's queue

            async def feed():
                async for out in st:
                    queue.put_nowait(out)

            self.feeds.append(asyncio.get_running_loop().create_task(feed()))
        return st

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tests.checkpoints import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def client(tok):
    llm = FakeLLM(tok)
    app = build_app(llm, "fake-model")
    with TestClient(app) as c:
        c.llm = llm
        yield c


def test_the_app_is_made_of_the_serving_classes():
    assert all(callable(cls.__init__) for cls in (OpenAIServingCompletion, OpenAIServingModels, OpenAIServingTokenization))
    assert callable(add_dashboard)


def test_completion_not_streamed(client):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 5})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "".join(WORDS) and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == sum(len(client.llm.tokenizer.encode(w)) for w in WORDS)


def test_completion_streamed_reassembles(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(WORDS)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_unknown_model_is_a_404_and_bad_input_a_400(client):
    r = client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={"prompt": "hi", "suffix": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_models_health_and_tokenize(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 128
    assert client.get("/health").status_code == 200
    ids = client.post("/tokenize", json={"prompt": "sunny days"}).json()["tokens"]
    assert ids == client.llm.tokenizer.encode("sunny days")
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "sunny days"
    assert client.get("/health").json() == {"status": "ok", "kv_audit": {"failures": 0, "last_error": None}}
    client.llm.stats.kv_audit_failures, client.llm.stats.kv_audit_error = 1, "3 blocks still referenced"
    assert client.get("/health").json()["kv_audit"] == {"failures": 1, "last_error": "3 blocks still referenced"}
    assert "pagedserve:kv_audit_failures_total" in client.get("/metrics").text
    client.llm.is_alive = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
