"""LoRA adapters on the server: `--lora-modules name=path ...` at start, and vLLM's
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (bodies {lora_name, lora_path})
at run time, refused (400) unless `--allow-runtime-lora-updating`; both are behind
`--api-key` like every path. A request's `model` field names the adapter
(ServingContext.check_model); /v1/models lists them with the base as `parent`.

Each adapter gets a fresh `lora_int_id` (never reused), so a reloaded name never shares
KV blocks or weights with its earlier version. Unloading removes the name at once (new
requests naming it get a 404) while requests already running or queued with it finish:
the engine core drops the weights after the last of them.
"""

from __future__ import annotations

import asyncio
import itertools
import json

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedserve.lora import LoRARequest
from pagedserve.server.http_errors import APIError, quote
from pagedserve.server.serving_base import ServingContext


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """`name=path` or JSON {"name", "path"} -> (name, path); ValueError naming the bad one."""
    out = []
    for spec in specs or ():
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                out.append((str(d["name"]), str(d["path"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {spec!r} is not JSON with 'name' and 'path'.") from None
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {spec!r} is not name=path.")
        out.append((name, path))
    return out


class OpenAIServingLoRA:
    def __init__(self, ctx: ServingContext, allow_runtime_updates: bool) -> None:
        self.ctx = ctx
        self.allow_runtime_updates = allow_runtime_updates
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter (ValueError naming what is wrong) and serve it under `name`."""
        if name in self.ctx.loras or name in self.ctx.served:
            raise ValueError(f"a model named {name!r} is already served.")
        checker = getattr(self.ctx.llm.input_processor, "lora", None)
        if checker is None or not checker.enabled:
            raise ValueError("LoRA adapters need the engine started with --enable-lora.")
        req = LoRARequest(name, next(self._ids), path)
        checker.check(req)
        self.ctx.loras[name] = req
        return req

    def _check_allowed(self) -> None:
        if not self.allow_runtime_updates:
            raise APIError(
                400,
                "loading and unloading LoRA adapters at run time is off (start with --allow-runtime-lora-updating).",
                param=None,
                code="runtime_lora_updating_disabled",
            )

    async def load(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        self._check_allowed()
        try:  # reads the file's header: off the event loop
            await asyncio.to_thread(self.add, body.lora_name, body.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        self._check_allowed()
        req = self.ctx.loras.get(body.lora_name)
        if req is None or (body.lora_int_id is not None and body.lora_int_id != req.lora_int_id):
            raise APIError(
                404, f"The LoRA adapter {quote(body.lora_name)} is not loaded.", "not_found_error", "lora_name",
                "model_not_found",
            )
        del self.ctx.loras[body.lora_name]
        self.ctx.llm.remove_lora(req.lora_int_id)  # its running requests finish first
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
