"""POST /v1/embeddings (OpenAI's shape), /score (vLLM's) and /rerank (Cohere's and Jina's),
on a server whose model runs as a pooling model (`--runner pooling`). Each input is one
engine request through the same scheduler and paged KV cache as generation (prompt only,
its blocks freed at once; prefix caching shares a document's blocks between requests).
Scores are cosine similarities of normalized embeddings. On a generating server these
paths answer 400, as completions do on a pooling server."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import PoolingParams, SamplingParams
from pagedserve.server.http_errors import to_api_error


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: str
    documents: list[str] | list[dict[str, Any]]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


def _inputs(value) -> list:
    """The prompts of an embeddings input: strings or token-id lists."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError("input must not be empty.", "input")
    if all(isinstance(x, int) for x in value):
        return [{"prompt_token_ids": list(value)}]
    return [{"prompt_token_ids": list(x)} if isinstance(x, list) else x for x in value]


def encode(vec: list[float], fmt: str):
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = sum(x * x for x in a) ** 0.5, sum(y * y for y in b) ** 0.5
    return dot / (na * nb) if na and nb else 0.0


class ServingPooling:
    def __init__(self, ctx) -> None:
        self.ctx = ctx

    async def _embed(self, prompts: list, request: Request, dims: int | None = None, normalize=None):
        """(vectors in prompt order, prompt tokens): one engine request per prompt."""
        for p in prompts:
            if isinstance(p, str):
                self.ctx.check_text_size(len(p.encode("utf-8")), "input")
        params = SamplingParams(max_tokens=0, pooling=PoolingParams(dims, normalize))
        tracker = self.ctx.admit(len(prompts), request.scope)
        try:
            await tracker.add(prompts, params, f"embd-{uuid.uuid4().hex}", 0, suffix=True)
            finals = await tracker.finals()
        finally:
            tracker.close()
        return [o.outputs.embedding for o in finals], sum(len(o.prompt_token_ids) for o in finals)

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> dict:
        self.ctx.check_model(body.model)
        if body.encoding_format not in ("float", "base64"):
            raise to_api_error(InvalidRequestError("encoding_format must be float or base64.", "encoding_format"))
        try:
            prompts = _inputs(body.input)
        except ValueError as e:
            raise to_api_error(e) from None
        vecs, n = await self._embed(prompts, request, body.dimensions)
        data = [{"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)} for i, v in enumerate(vecs)]
        return {"object": "list", "data": data, "model": self.ctx.model_name, "usage": {"prompt_tokens": n, "total_tokens": n}}

    async def score(self, body: ScoreRequest, request: Request) -> dict:
        self.ctx.check_model(body.model)
        a = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
        b = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
        if not b or (len(a) != 1 and len(a) != len(b)):
            raise to_api_error(InvalidRequestError("text_1 must be one text or as many as text_2 (non-empty).", "text_1"))
        vecs, n = await self._embed(a + b, request, normalize=True)
        left, right = vecs[: len(a)], vecs[len(a) :]
        data = [{"index": i, "object": "score", "score": cosine(left[0 if len(a) == 1 else i], v)} for i, v in enumerate(right)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.ctx.model_name, "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}

    async def rerank(self, body: RerankRequest, request: Request) -> dict:
        self.ctx.check_model(body.model)
        docs = [d if isinstance(d, str) else d.get("text") for d in body.documents]
        if not docs or any(not isinstance(d, str) for d in docs):
            raise to_api_error(InvalidRequestError("documents must be a non-empty list of strings or {'text': ...}.", "documents"))
        vecs, n = await self._embed([body.query, *docs], request, normalize=True)
        scored = sorted(((cosine(vecs[0], v), i) for i, v in enumerate(vecs[1:])), reverse=True)[: body.top_n or len(docs)]
        results = [{"index": i, "relevance_score": s, **({"document": {"text": docs[i]}} if body.return_documents else {})}
                   for s, i in scored]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.ctx.model_name, "usage": {"total_tokens": n}, "results": results}
