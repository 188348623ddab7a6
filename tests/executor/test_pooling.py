"""Pooling models (runner="pooling"): embeddings equal transformers' last_hidden_state
pooled as each mode says (last token, mean, CLS; normalized or not), within 1e-5 cosine
distance, batched, chunked, with prefix-cache hits; the model's sentence-transformers
files pick the mode; Matryoshka dimensions where the config allows; wrong-runner
requests refused naming the field; the server's /v1/embeddings, /score and /rerank."""

import base64
import json
import shutil
import struct

import httpx
import pytest
import torch

from pagedserve import PoolingParams, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.executor.pooling import PoolerConfig, resolve_pooler
from pagedserve.frontend.llm import LLM

KW = dict(dtype="float32", num_kv_blocks=200, max_model_len=512)
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17, 90])]


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def reference(path):
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def states(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]

    return states


def pooled(h, kind, normalize=True):
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[kind]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def close(ours, want):
    ours = torch.tensor(ours)
    cos = torch.nn.functional.cosine_similarity(ours, want, dim=0).item()
    return 1 - cos < 1e-5 and torch.allclose(ours, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,budget", [("last", 2048), ("last", 16), ("mean", 16), ("cls", 16), ("mean", 2048)])
def test_embeddings_match_transformers(path, reference, kind, budget):
    llm = LLM(path, runner="pooling", pooling_type=kind, max_num_batched_tokens=budget, **KW)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert close(o.outputs.embedding, pooled(reference(p), kind)), (kind, budget)
    # a second pass hits the prefix cache (last-token pooling) or recomputes (mean, CLS): the same vectors
    again = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for a, b in zip(again, outs):
        assert a.outputs.embedding == pytest.approx(b.outputs.embedding, abs=1e-5)
    if kind == "last":
        assert sum(o.num_cached_tokens for o in again) > 0
    unnorm = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    assert close(unnorm.outputs.embedding, pooled(reference(PROMPTS[1]), kind, normalize=False))
    assert llm.get_stats().kv_blocks_used == 0
    llm.shutdown()


def test_last_token_pooling_runs_the_last_mlp_on_the_last_rows_only(path, reference):
    """A step of last-token pooling reads one hidden state per finished prompt: the last
    layer's MLP sees just those rows (chunks that end no prompt: none), the vectors unchanged."""
    llm = LLM(path, runner="pooling", max_num_batched_tokens=64, engine_core_process=False, **KW)
    mlp = llm.engine.core.engine_core.executor.runner.model.layers[-1].mlp
    rows, forward = [], mlp.forward
    mlp.forward = lambda x, kern=None: rows.append(x.shape[0]) or forward(x, kern)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert close(o.outputs.embedding, pooled(reference(p), "last"))
    # 152 prompt tokens in steps of <= 64: every prompt's last row once, nothing else
    assert sum(rows) == len(PROMPTS) and max(rows) < 64
    llm.shutdown()


def test_sentence_transformers_files_pick_the_pooling(path, reference, tmp_path):
    d = tmp_path / "st"
    shutil.copytree(path, d)
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    cfg = resolve_pooler(str(d), {"hidden_size": 64}, None, None)
    assert cfg.pooling_type == "mean" and cfg.normalize is False  # no Normalize module
    llm = LLM(str(d), runner="pooling", **KW)
    (o,) = llm.embed({"prompt_token_ids": PROMPTS[2]}, use_tqdm=False)
    assert close(o.outputs.embedding, pooled(reference(PROMPTS[2]), "mean", normalize=False))


def test_matryoshka_dimensions_only_where_the_model_allows(path, tmp_path):
    llm = LLM(path, runner="pooling", **KW)
    with pytest.raises(InvalidRequestError) as e:
        llm.embed("x", PoolingParams(dimensions=8), use_tqdm=False)
    assert e.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "model"
    scores = llm.score("sunny day", ["sunny day", "a cat"], use_tqdm=False)
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] < 1.0
    cfg = PoolerConfig("last", True, 64, ())
    cfg.check_dimensions(16)
    with pytest.raises(InvalidRequestError):
        PoolerConfig("last", True, 64, (32, 16)).check_dimensions(8)
    gen = LLM(path, **KW)
    with pytest.raises(InvalidRequestError, match="generates text") as e:
        gen.embed("x", use_tqdm=False)


def test_task_embed_is_the_older_spelling(path):
    llm = LLM(path, task="embed", **KW)
    assert llm.engine.pooler is not None


def test_server_endpoints(path, reference):
    from tests.server.test_server import MODEL, Server

    s = Server(path, engine_kw={"runner": "pooling"})
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"model": MODEL, "input": [PROMPTS[0], PROMPTS[1]]}).json()
        assert [d["index"] for d in r["data"]] == [0, 1] and r["usage"]["prompt_tokens"] == 45
        assert close(r["data"][1]["embedding"], pooled(reference(PROMPTS[1]), "last"))
        b = httpx.post(s.url + "/v1/embeddings", json={"input": PROMPTS[0], "encoding_format": "base64"}).json()
        raw = base64.b64decode(b["data"][0]["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(r["data"][0]["embedding"], abs=1e-6)
        sc = httpx.post(s.url + "/score", json={"text_1": "hello", "text_2": ["hello", "world"]}).json()
        assert sc["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
        rr = httpx.post(s.url + "/rerank", json={"query": "hello", "documents": ["world", "hello"], "top_n": 1}).json()
        assert [x["index"] for x in rr["results"]] == [1] and rr["results"][0]["document"]["text"] == "hello"
        bad = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "x", "dimensions": 4}).json()["error"]["param"] == "dimensions"
    finally:
        s.stop()
    g = Server(path)
    try:
        bad = httpx.post(g.url + "/v1/embeddings", json={"input": "x"})
        assert bad.status_code == 400 and "generates text" in bad.json()["error"]["message"]
    finally:
        g.stop()
