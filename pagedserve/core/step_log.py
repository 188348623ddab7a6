"""The step log (`--step-log PATH`): one JSON line per engine step, for offline study of
what a step costs (`python -m pagedserve.bench.mixed_sim fit` fits a step-time model on
it, and replays workloads through the real scheduler on that model).

A line: `[end time (s since the epoch), seconds (schedule + forward + update),
[[short, tokens, computed], ...]]`, one triple per scheduled request: 1 if the
length-aware policy counts it short, the tokens it ran this step (1 for a decode), and
its tokens already in the KV cache before the step (a speculative verification row counts
its drafts among its tokens). Written in the engine core's loop, buffered (flushed when the
engine goes idle and at shutdown); a step costs one pass over its batch. With data
parallelism each replica writes PATH.dpN.
"""

from __future__ import annotations

import json
import time


class StepLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (open as long as the engine)

    def rows(self, scheduled, requests) -> list[list[int]]:
        """Each scheduled request's triple; call before the step's update (a request that
        finishes in it leaves `requests`)."""
        out = []
        for sr in scheduled:
            r = requests.get(sr.req_id)
            out.append([int(r is not None and r.is_short), len(sr.token_ids), sr.num_computed_tokens])
        return out

    def write(self, seconds: float, rows: list[list[int]]) -> None:
        self._file.write(json.dumps([round(time.time(), 4), round(seconds, 6), rows], separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
