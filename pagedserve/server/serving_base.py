"""What every OpenAI endpoint shares: the `ServingContext` (engine, model names,
metrics, admission, the live trackers, the drain at shutdown). Errors live in
http_errors.py, response pieces in responses.py, admission and the per-request tracker
in admission.py.

Lifecycle of one HTTP request: `ServingContext.admit()` checks the model and takes
admission slots (refusing at once when full), then `RequestTracker.add()` sends each
prompt to the engine (all prompts of a list at once, as separate engine requests).
Outputs arrive on the tracker's single queue. The tracker is closed exactly once, by
whoever ends the request first: the handler when the request finishes, the ASGI guard
when the client leaves (it cancels the handler, see `middleware.py`), or the drain at
shutdown. Closing aborts whatever is still running in the engine (freeing its KV
blocks) and gives the admission slots back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from pagedserve.lora import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SLO
from pagedserve.server.admission import AdmissionLimiter, RequestTracker
from pagedserve.server.http_errors import APIError, bad_request, quote
from pagedserve.server.responses import LogprobFormatter

logger = logging.getLogger(__name__)

CLEANUP_KEY = "pagedserve.cleanup"  # scope key: callbacks the ASGI guard runs when a request ends


# -- shared state of the endpoints ---------------------------------------------------------------

# what a request still open at shutdown is told when an engine fault caused the shutdown
_ABORT_MESSAGES = {"engine_dead": "the engine is not running", "engine_stalled": "the engine stalled"}

class ServingContext:
    def __init__(
        self,
        llm,
        model_name: str,
        metrics,
        limiter: AdmissionLimiter,
        trust_request_chat_template: bool = False,
        compact_json: bool = False,
        default_slo: SLO | None = None,
        request_timeout: float | None = None,
    ) -> None:
        self.request_timeout = request_timeout  # --request-timeout (seconds; None: none)
        self.llm = llm
        self.default_slo = default_slo  # --default-slo: for requests that bring no "slo"
        # --structured-outputs-disable-any-whitespace: JSON constraints without free whitespace
        self.compact_json = compact_json
        self.model_name = model_name
        self.metrics = metrics
        self.limiter = limiter
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.config.scheduler.max_model_len
        self.served = {model_name, llm.config.model.model}
        self.loras: dict[str, LoRARequest] = {}  # served LoRA adapters by name (serving_lora.py)
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.trackers: set[RequestTracker] = set()
        self.draining = False
        self.drain_fault: str | None = None  # engine_dead / engine_stalled: why the server drains, if a fault
        # Cheap pre-check before tokenizing: no token is longer than this many UTF-8 bytes,
        # so a text of more than max_model_len * this many bytes can never fit.
        self.max_prompt_bytes = self.max_model_len * _max_token_bytes(self.tokenizer)

    def observe_finished(self, out: RequestOutput) -> None:
        with contextlib.suppress(Exception):
            self.metrics.observe_finished(out)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 if unknown."""
        lora = self.loras.get(model) if model is not None else None
        if lora is not None:
            return lora
        if model is not None and model not in self.served:
            raise APIError(
                404,
                f"The model {quote(model)} does not exist.",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def admit(self, num_prompts: int, scope: dict, timeout: float | None = None, lora=None) -> RequestTracker:
        """Take `num_prompts` admission slots (one per prompt of a list) or refuse now.
        `timeout`: the request's own deadline in seconds (the server's --request-timeout
        caps it); past it the request is aborted with a 504. `lora`: the adapter its
        engine requests run with (check_model's answer)."""
        if self.drain_fault is not None:  # draining for an engine fault: say which
            raise APIError(503, _ABORT_MESSAGES[self.drain_fault], "server_error", code=self.drain_fault)
        if self.draining:
            self.metrics.rejected("shutting_down")
            raise APIError(
                503,
                "server is shutting down",
                "server_error",
                code="shutting_down",
                headers={"Retry-After": "1"},
            )
        if not self.llm.is_alive:
            raise APIError(503, "the engine is not running", "server_error", code="engine_dead")
        if not self.limiter.try_acquire(num_prompts):
            self.metrics.rejected("overloaded")
            raise APIError(
                503,
                f"server is overloaded: {self.limiter.in_flight} requests in flight "
                f"(limit {self.limiter.capacity}); retry later",
                "server_overloaded",
                code="server_overloaded",
                headers={"Retry-After": "1"},
            )
        tracker = RequestTracker(self, num_prompts)
        tracker.lora = lora
        limits = [t for t in (timeout, self.request_timeout) if t is not None]
        if limits:
            tracker.set_deadline(min(limits))
        self.trackers.add(tracker)
        scope.setdefault(CLEANUP_KEY, []).append(tracker.close)
        return tracker

    def check_text_size(self, text_bytes: int, param: str) -> None:
        if text_bytes > self.max_prompt_bytes:
            raise bad_request(
                f"the input is {text_bytes} bytes, more than can fit in max_model_len="
                f"{self.max_model_len} tokens.",
                param,
            )

    async def drain(self, timeout: float, grace: float = 2.0, error: tuple[str, str, int] | None = None) -> None:
        """Shutdown: refuse new requests, let running ones finish for `timeout` seconds,
        then end the rest (streams get a final chunk and [DONE], others an error body;
        `error`: its (type, code, status) instead of a shutdown's, RequestTracker.abort)."""
        self.draining = True
        self.drain_fault = error[1] if error is not None and error[1] in _ABORT_MESSAGES else None
        deadline = time.monotonic() + timeout
        while self.trackers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.trackers:
            logger.info("drain window over: aborting %d requests", len(self.trackers))
        for t in list(self.trackers):
            t.abort(_ABORT_MESSAGES.get(error[1], "server is shutting down") if error else "server is shutting down", error)
        deadline = time.monotonic() + grace
        while self.trackers and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def _max_token_bytes(tokenizer) -> int:
    try:
        vocab = tokenizer.get_vocab()
        return max(8, max(len(t.encode("utf-8", "surrogatepass")) for t in vocab))
    except Exception:  # noqa: BLE001 (no usable vocabulary: no pre-check)
        return 1 << 20
