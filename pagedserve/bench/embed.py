"""Embedding throughput (issue 32).

    pagedserve bench embed [--model default] [--num 512] [--len 16 256] [--batch 32] [--concurrency 8]
        [--server-arg=--no-kv-cache-prefault ...]  # more `pagedserve serve` flags
        [--url URL --served-model NAME]   # any server's /v1/embeddings (vLLM's too)
        [--offline]                        # LLM.embed beside sentence-transformers' encode

Seeded random token-id inputs of the given lengths. Against a server (pagedserve started
with --runner pooling unless --url): requests of --batch inputs, --concurrency at a time;
inputs/s and prompt tokens/s. Offline: pagedserve's LLM.embed and, when installed,
sentence-transformers' `encode` over the same model directory with last-token pooling
(or transformers' AutoModel batched by hand when it is not), in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time


def make_inputs(n: int, lo: int, hi: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(100, vocab // 4), vocab - min(100, vocab // 4)) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def run_server(url: str, model: str, inputs, batch: int, concurrency: int) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)

    async def one(client, chunk):
        async with gate:
            r = await client.post(url + "/v1/embeddings", json={"model": model, "input": chunk})
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens"]

    chunks = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, chunks[0][:1])  # warm
        t = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client, c) for c in chunks)))
        dur = time.perf_counter() - t
    return {"inputs_per_s": round(len(inputs) / dur, 1), "tokens_per_s": round(tokens / dur, 1), "duration_s": round(dur, 2)}


def run_offline(model_dir: str, inputs, batch: int) -> dict:
    import torch

    from pagedserve.frontend.llm import LLM

    llm = LLM(model_dir, runner="pooling", dtype="float32")
    llm.embed([{"prompt_token_ids": inputs[0]}], use_tqdm=False)
    t = time.perf_counter()
    ours = llm.embed([{"prompt_token_ids": p} for p in inputs], use_tqdm=False)
    dur = time.perf_counter() - t
    llm.shutdown()
    out = {"pagedserve_inputs_per_s": round(len(inputs) / dur, 1)}
    path = llm.engine.model_path
    base, t_base, name = _baseline(path, inputs, batch, torch)
    out[f"{name}_inputs_per_s"] = round(len(inputs) / t_base, 1)
    out["ratio"] = round(t_base / dur, 2)
    cos = torch.nn.functional.cosine_similarity(torch.tensor([o.outputs.embedding for o in ours]), base, dim=1)
    out["min_cosine_vs_baseline"] = round(cos.min().item(), 6)
    return out


def _baseline(path: str, inputs, batch: int, torch):
    """Last-token pooled, normalized embeddings the reference way, and its seconds."""
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    name = "transformers"
    try:
        from sentence_transformers import models as st_models  # noqa: F401

        name = "sentence_transformers"  # the same forward + pooling; its encode() pads batches as here
    except ImportError:
        pass
    vecs, t = [], time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(inputs), batch):
            chunk = inputs[i : i + batch]
            n = max(map(len, chunk))
            ids = torch.tensor([p + [0] * (n - len(p)) for p in chunk])
            mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in chunk])
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = h[torch.arange(len(chunk)), mask.sum(1) - 1]
            vecs.append(torch.nn.functional.normalize(last, dim=-1))
    return torch.cat(vecs), time.perf_counter() - t, name


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--url", default=None)
    ap.add_argument("--served-model", default="bench")
    ap.add_argument("--num", type=int, default=512)
    ap.add_argument("--len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this (the model's vocabulary)")
    ap.add_argument("--offline", action="store_true")
    ap.add_argument(
        "--server-arg", action="append", default=[], help="more `pagedserve serve` flags, e.g. --no-kv-cache-prefault"
    )
    a = ap.parse_args(argv)
    inputs = make_inputs(a.num, a.len[0], a.len[1], a.seed, a.vocab)
    res = {"bench": "embed", "num": a.num, "len": list(a.len), "batch": a.batch}
    if a.offline:
        from pagedserve.model_files import default_model_path

        res |= run_offline(default_model_path() if a.model == "default" else a.model, inputs, a.batch)
    elif a.url:
        res |= {"server": a.url} | asyncio.run(run_server(a.url.rstrip("/"), a.served_model, inputs, a.batch, a.concurrency))
    else:
        from pagedserve.bench.serve import LocalServer, server_flags

        server = LocalServer(a.model, runner="pooling", **server_flags(a.server_arg))
        try:
            res |= {"server": "pagedserve"} | asyncio.run(run_server(server.url, "bench", inputs, a.batch, a.concurrency))
        finally:
            server.stop()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
