"""LoRA adapters on the server (issue 33): --lora-modules, the request's `model` picks
the adapter (greedy tokens as transformers + PEFT's), /v1/models lists adapters with their
parent, run-time load / unload behind --api-key (refused without
--allow-runtime-lora-updating), an unknown model a 404, a bad adapter a 400 naming what is
wrong, and unloading an adapter in use lets its running request finish."""

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedserve.server.http_errors import APIError  # noqa: E402
from pagedserve.server.serving_lora import (  # noqa: E402
    LoadLoRAAdapterRequest,
    OpenAIServingLoRA,
    parse_lora_modules,
)
from tests.executor.test_lora import hf_logits, hf_with_adapters, make_adapters  # noqa: E402
from tests.server.test_server import MODEL, Server  # noqa: E402

KEY = {"Authorization": "Bearer k"}
PROMPT = [(5 * i + 2) % 1000 for i in range(18)]


@pytest.fixture(scope="module")
def lora_server(checkpoint, tmp_path_factory):
    path = checkpoint("llama")
    dirs = make_adapters(path, tmp_path_factory, ("qv", "mlp"))
    s = Server(path, engine_kw=dict(enable_lora=True, max_loras=2), api_key="k",
               lora_modules=[f"qv={dirs['qv']}"], allow_runtime_lora_updating=True)
    yield s, path, dirs
    s.stop()


def _complete(url, model, max_tokens=5, stream=False):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    return httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, headers=KEY, timeout=60)


def _tokens(resp):
    lp = resp.json()["choices"][0]["logprobs"]
    return lp["tokens"]


def test_adapters_served_listed_loaded_unloaded(lora_server):
    s, path, dirs = lora_server
    models = httpx.get(f"{s.url}/v1/models", headers=KEY).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("qv", MODEL)]
    model = hf_with_adapters(path, dirs)
    tok = s.async_llm.tokenizer
    for name in ("qv", None):
        r = _complete(s.url, name or MODEL)
        assert r.status_code == 200, r.text
        ids = list(PROMPT)
        for _ in range(5):
            ids.append(int(hf_logits(model, name, ids)[-1].argmax()))
        assert r.json()["choices"][0]["text"] == tok.decode(ids[18:])
    r = _complete(s.url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # run-time loading: behind the key; a bad path is a 400 naming what is missing
    load = f"{s.url}/v1/load_lora_adapter"
    assert httpx.post(load, json={"lora_name": "mlp", "lora_path": dirs["mlp"]}).status_code == 401
    bad = httpx.post(load, json={"lora_name": "x", "lora_path": path}, headers=KEY)
    assert bad.status_code == 400 and "missing adapter_config.json" in bad.json()["error"]["message"]
    assert httpx.post(load, json={"lora_name": "mlp", "lora_path": dirs["mlp"]}, headers=KEY).status_code == 200
    assert _complete(s.url, "mlp").status_code == 200
    # unloading while a request of the adapter streams: it finishes, then the name is gone
    with httpx.stream("POST", f"{s.url}/v1/completions", headers=KEY, timeout=60, json={
            "model": "mlp", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True}) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        un = httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=KEY)
        assert un.status_code == 200
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    chunks = [json.loads(first[6:]), *rest]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert _complete(s.url, "mlp").status_code == 404
    unknown = httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=KEY)
    assert unknown.status_code == 404


def test_runtime_updates_refused_without_the_flag_and_module_specs():
    lora = OpenAIServingLoRA(ctx=None, allow_runtime_updates=False)
    with pytest.raises(APIError) as e:
        asyncio.run(lora.load(LoadLoRAAdapterRequest(lora_name="a", lora_path="/x")))
    assert e.value.status == 400 and "--allow-runtime-lora-updating" in e.value.message
    assert parse_lora_modules(["a=/p", '{"name": "b", "path": "/q"}']) == [("a", "/p"), ("b", "/q")]
    with pytest.raises(ValueError, match="not name=path"):
        parse_lora_modules(["nopath"])
