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
        """The base model, then each served LoRA adapter with the base as its `parent`."""
        ctx, now = self.ctx, int(time.time())
        base = {
            "id": ctx.model_name,
            "object": "model",
            "created": now,
            "owned_by": "pagedserve",
            "root": ctx.llm.config.model.model,
            "parent": None,
            "max_model_len": ctx.max_model_len,
        }
        adapters = [
            {**base, "id": name, "root": lora.lora_path, "parent": ctx.model_name} for name, lora in ctx.loras.items()
        ]
        return {"object": "list", "data": [base, *adapters]}

    async def health(self) -> Response:
        """200 {"status": "ok"} while the engine runs and makes progress; 503 with the reason
        when its core died (code engine_dead) or stalls (engine_stalled). Either way the
        body names the last KV accounting audit failure, if any (core/kv_audit.py)."""
        llm = self.ctx.llm
        audit = {"failures": getattr(llm.stats, "kv_audit_failures", 0), "last_error": getattr(llm.stats, "kv_audit_error", None)}
        if not llm.is_alive:
            body = error_body("the engine is not running", "server_error", None, "engine_dead")
            return JSONResponse({**body, "kv_audit": audit}, 503)
        stalled = llm.stall_reason() if hasattr(llm, "stall_reason") else None
        if stalled is not None:
            body = error_body(stalled, "server_error", None, "engine_stalled")
            return JSONResponse({**body, "kv_audit": audit}, 503)
        return JSONResponse({"status": "ok", "kv_audit": audit}, 200)

    async def metrics(self) -> Response:
        return Response(self.ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
