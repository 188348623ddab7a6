"""What an engine step costs in seconds, as a function of its batch: the model the step
log's offline fits use (`python -m pagedserve.bench.mixed_sim fit`) and the one the
length-aware policy fits online to size the long lane in seconds (`long_lane_step_ms`).

A step's features (`step_features`): a constant, its decode rows, their context (per 1,000
tokens: decode attention), its prefill tokens (per 100), with extra slopes above 128 and
256 of them (small chunks cost more per token: the weights are read once a step), and
prefill tokens times their context (per 1e5: prefill attention). Seconds are linear in the
features. A row is `(tokens, computed)`: tokens run this step (1: a decode) and tokens
already in the KV cache before it.

`OnlineStepCost` keeps the last `window` steps' sums of x x^T and x y and solves the ridge
normal equations as soon as it has `min_steps` steps of which `min_prefill_steps` ran
prefill tokens (before, `ready` is False: it predicts nothing), then every `refit_every`. Cost: one 7-vector outer
product a step, one 7x7 solve every `refit_every` steps.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable

import numpy as np

HINGES = (128, 256)  # prefill-token counts where the per-token cost changes
FEATURES = ("const", "decode_rows", "decode_ctx_k", "prefill_100", "prefill_attn_1e5") + tuple(
    f"prefill_over_{h}_100" for h in HINGES
)
OUTLIER_FACTOR, OUTLIER_SLACK_S = 3.0, 0.05  # a fitted model's bound on one step's time (observe)


def features_of(decode_rows: int, decode_ctx: int, prefill: int, attn: float) -> list[float]:
    """The feature vector of a step with these totals (attn: the sum over prefill chunks of
    tokens * (context + tokens / 2))."""
    hinges = [max(0, prefill - h) / 100 for h in HINGES]
    return [1.0, decode_rows, decode_ctx / 1000, prefill / 100, attn / 1e5, *hinges]


def step_features(rows: Iterable) -> list[float]:
    """A step's features from its rows; a row's last two fields are (tokens, computed) (a
    step-log row `[short, tokens, computed]` works as it is)."""
    decode_rows = decode_ctx = prefill = 0
    attn = 0.0
    for *_, tokens, computed in rows:
        if tokens == 1:
            decode_rows += 1
            decode_ctx += computed
        else:
            prefill += tokens
            attn += tokens * (computed + tokens / 2)
    return features_of(decode_rows, decode_ctx, prefill, attn)


class OnlineStepCost:
    """The step-time model fitted on this engine's recent steps (see the module)."""

    def __init__(
        self, window: int = 2048, refit_every: int = 32, min_steps: int = 64, min_prefill_steps: int = 16, ridge: float = 1e-6
    ) -> None:
        self.window, self.refit_every = window, refit_every
        self.min_steps, self.min_prefill_steps, self.ridge = min_steps, min_prefill_steps, ridge
        n = len(FEATURES)
        self._rows: deque[tuple[np.ndarray, float]] = deque()
        self._xx = np.zeros((n, n))
        self._xy = np.zeros(n)
        self._prefill_steps = 0  # in the window
        self._since_fit = 0
        self.coef: np.ndarray | None = None

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def observe(self, feats: list[float], seconds: float) -> None:
        """One step's features and measured seconds. Once fitted, a time over
        OUTLIER_FACTOR x the model's (a pause of the process, a noisy neighbour) counts
        as that bound: one such step does not skew the fit for a whole window, and a CPU
        that really became slower still pulls the fit up, step by step."""
        x = np.asarray(feats, dtype=np.float64)
        if self.coef is not None:
            seconds = min(seconds, OUTLIER_FACTOR * max(self.predict(x), 0.0) + OUTLIER_SLACK_S)
        self._add(x, seconds, 1.0)
        self._rows.append((x, seconds))
        if len(self._rows) > self.window:
            self._add(*self._rows.popleft(), -1.0)
        self._since_fit += 1
        if self._since_fit >= self.refit_every or (self.coef is None and self._enough()):
            self._since_fit = 0
            self._refit()

    def _add(self, x: np.ndarray, y: float, sign: float) -> None:
        self._xx += sign * np.outer(x, x)
        self._xy += sign * y * x
        self._prefill_steps += int(sign) * (x[3] > 0)

    def _enough(self) -> bool:
        return len(self._rows) >= self.min_steps and self._prefill_steps >= self.min_prefill_steps

    def _refit(self) -> None:
        if not self._enough():
            return
        n = len(self._rows)
        reg = self.ridge * n * np.eye(len(FEATURES))
        reg[0, 0] = 0.0  # the constant is not shrunk
        with contextlib.suppress(np.linalg.LinAlgError):  # singular: keep the last fit
            self.coef = np.linalg.solve(self._xx + reg, self._xy)

    def predict(self, feats) -> float:
        """Seconds the model gives a step with these features (ready only)."""
        return float(np.dot(self.coef, feats))

    def prefill_within(self, seconds: float, base: tuple[int, int, int, float], context: int, most: int, step: int = 16) -> int:
        """The most prompt tokens (a multiple of `step`, or `most`) that one chunk at
        `context` tokens of cached context may add to a step with totals `base` (decode
        rows, their context, prefill tokens, prefill attention) while the model keeps the
        step within `seconds`; 0 when not even `step` tokens fit. Scans down from `most`,
        so a fit that is not monotone in the tokens still gets an exact answer."""
        rows, ctx, prefill, attn = base
        n = most
        while n > 0:
            if self.predict(features_of(rows, ctx, prefill + n, attn + n * (context + n / 2))) <= seconds:
                return n
            n = (n - 1) // step * step
        return 0
