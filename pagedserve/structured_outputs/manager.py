"""StructuredOutputManager: compiles grammars off the step loop and builds each step's bitmask.

The engine core owns one. A constrained request gets a `StructuredOutputRequest` at
admission: a future for its compiled grammar, from a thread pool through an LRU cache
keyed by the canonical spec (equal schemas compile once; concurrent equal requests
share one compile). The scheduler keeps the request waiting until `ready()`; then it
has its own matcher, advanced by `accept()` as tokens are appended. Each step, the rows
that sample get their legal next tokens in one int32 bitmask (`fill_bitmask`), which
the model runner applies to the logits (`bitmask.apply_grammar_bitmask`).

Preemption keeps a request's output tokens (they are recomputed, not resampled), so its
matcher stays valid and needs no replay; `replay()` rebuilds one from tokens if needed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pagedserve.structured_outputs.backend import (
    GrammarSpec,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    clean_error,
    grammar_spec,
)
from pagedserve.structured_outputs.bitmask import allocate_bitmask

logger = logging.getLogger(__name__)

BACKENDS = ("xgrammar", "llguidance")


def make_backend(
    name: str, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]
) -> StructuredOutputBackend:
    if name == "xgrammar":
        from pagedserve.structured_outputs.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "llguidance":
        from pagedserve.structured_outputs.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}; got {name!r}.")


class StructuredOutputRequest:
    """One request's grammar: pending (a future), then a matcher; or a compile error."""

    __slots__ = ("spec", "_future", "_manager", "grammar", "error")

    def __init__(self, spec: GrammarSpec, future: Future, manager: StructuredOutputManager) -> None:
        self.spec = spec
        self._future = future
        self._manager = manager
        self.grammar: StructuredOutputGrammar | None = None
        self.error: str | None = None

    def ready(self) -> bool:
        """True once compiled (then `grammar` is set) or failed (then `error` is set)."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        try:
            self.grammar = self._manager.backend.new_grammar(self._future.result())
        except Exception as e:  # a spec the front end's validation let through
            self.error = f"the grammar failed to compile: {clean_error(e)}"
            logger.warning("structured outputs: %s", self.error)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ready (tests and benchmarks; the engine never blocks)."""
        with contextlib.suppress(Exception):
            self._future.result(timeout)
        return self.ready()

    def accept(self, token: int) -> bool:
        """Advance over a sampled token. A terminated grammar (its stop token accepted)
        ignores what follows (ignore_eos / min_tokens keep a request going)."""
        g = self.grammar
        if g is None or g.is_terminated():
            return True
        if g.accept_tokens((token,)):
            return True
        logger.warning("structured outputs: sampled token %d is not allowed by the grammar", token)
        return False

    def replay(self, tokens: list[int]) -> bool:
        """Reset the matcher and accept `tokens` (e.g. output tokens after a lost state)."""
        if self.grammar is None:
            return False
        self.grammar.reset()
        return all(self.accept(t) for t in tokens)


class StructuredOutputManager:
    """Owned by the engine core. `tokenizer_loader` is called once, on the first
    constrained request (in the compile thread), as is the backend's construction."""

    def __init__(
        self,
        tokenizer_loader: Callable[[], object],
        vocab_size: int,
        backend: str = "xgrammar",
        cache_size: int = 256,
        max_workers: int = 1,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"structured outputs backend must be one of {', '.join(BACKENDS)}; got {backend!r}."
            )
        self.backend_name = backend
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._tokenizer_loader = tokenizer_loader
        self._backend: StructuredOutputBackend | None = None
        self._stop_token_ids: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="pagedserve-grammar")
        # counters
        self.cache_hits = 0
        self.cache_misses = 0
        self.compile_seconds: list[float] = []  # per compile, in completion order
        self.backend_init_seconds = 0.0

    # -- compilation --------------------------------------------------------------
    @property
    def backend(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None:
                t0 = time.perf_counter()
                self._backend = make_backend(
                    self.backend_name, self._tokenizer_loader(), self.vocab_size, self._stop_token_ids
                )
                self.backend_init_seconds = time.perf_counter() - t0
            return self._backend

    def _compile(self, spec: GrammarSpec):
        backend = self.backend
        t0 = time.perf_counter()
        compiled = backend.compile(spec)
        self.compile_seconds.append(time.perf_counter() - t0)
        return compiled

    def compiled_future(self, spec: GrammarSpec) -> Future:
        """The spec's compile: a cache hit, or a new job on the pool (LRU-evicting the oldest)."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(spec)
                self.cache_hits += 1
                return fut
            self.cache_misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # requests still hold their own future
            return fut

    def new_request(self, params, eos_token_ids: Iterable[int] = ()) -> StructuredOutputRequest:
        """A request's grammar (compiling in the background); `params` is its
        StructuredOutputsParams. The model's EOS ids are the grammar's stop tokens
        (taken from the first request, before the backend exists)."""
        if self._backend is None and not self._stop_token_ids:
            self._stop_token_ids = frozenset(eos_token_ids)
        spec = grammar_spec(params)
        return StructuredOutputRequest(spec, self.compiled_future(spec), self)

    # -- per step ---------------------------------------------------------------------
    def fill_bitmask(
        self, rows: list[tuple[str, StructuredOutputRequest]]
    ) -> tuple[dict[str, int], np.ndarray]:
        """One bitmask row per (request id, grammar), in order: ({id: row}, int32 [k, W])."""
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        ids: dict[str, int] = {}
        for i, (rid, so_req) in enumerate(rows):
            ids[rid] = i
            if so_req.grammar is not None:
                so_req.grammar.fill_bitmask(bitmask, i)
        return ids, bitmask

    def attach_bitmask(self, sched_out, requests: dict) -> None:
        """Set `sched_out.grammar_bitmask` and `structured_output_request_ids` for the
        scheduled requests that sample and are constrained (`requests`: id -> object with
        a `structured_output_request` attribute). Leaves them None when there are none."""
        rows = []
        for sr in sched_out.scheduled:
            if sr.sample:
                so_req = requests[sr.req_id].structured_output_request
                if so_req is not None and so_req.grammar is not None:
                    rows.append((sr.req_id, so_req))
        if rows:
            sched_out.structured_output_request_ids, sched_out.grammar_bitmask = self.fill_bitmask(rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
