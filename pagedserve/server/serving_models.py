"""GET /v1/models, /health, /metrics."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse, Response

from pagedserve.server.http_errors import error_body
from pagedserve.server.serving_base import ServingContext


class OpenAIServingModels:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.ctx.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pagedserve",
                    "max_model_len": self.ctx.max_model_len,
                }
            ],
        }

    async def health(self) -> Response:
        if not self.ctx.llm.is_alive:
            return JSONResponse(
                error_body("the engine is not running", "server_error", None, "engine_dead"), 503
            )
        return Response(status_code=200)

    async def metrics(self) -> Response:
        return Response(self.ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
