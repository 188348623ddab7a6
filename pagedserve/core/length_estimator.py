"""How many tokens a request will generate, learned online from finished requests.

A request whose client gave `max_tokens` is expected to use it (the client's word always
wins). Otherwise the estimate is the running mean output length of finished requests
whose prompts had a similar length (same power-of-two bucket), falling back to the mean
over all finished requests, and to `prior` before any has finished. The mean is exact
over the first `window` finishes of a bucket and exponentially weighted (weight 1/window)
after, so it follows a workload that drifts. One estimator per engine (per served model).
"""

from __future__ import annotations


def _bucket(num_prompt_tokens: int) -> int:
    return max(num_prompt_tokens, 1).bit_length()


class OutputLengthEstimator:
    def __init__(self, prior: int, window: int = 64) -> None:
        self.prior = prior
        self.window = window
        self._means: dict[int, tuple[float, int]] = {}  # bucket -> (mean, count)
        self._all: tuple[float, int] = (0.0, 0)

    def observe(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A finished request's prompt and output lengths."""
        b = _bucket(num_prompt_tokens)
        self._means[b] = self._update(self._means.get(b, (0.0, 0)), num_output_tokens)
        self._all = self._update(self._all, num_output_tokens)

    def _update(self, state: tuple[float, int], x: int) -> tuple[float, int]:
        mean, n = state
        n += 1
        return mean + (x - mean) / min(n, self.window), n

    def expected_output(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Tokens the request is expected to generate (at least 1)."""
        if max_tokens is not None:
            return max(1, max_tokens)
        mean, n = self._means.get(_bucket(num_prompt_tokens), (0.0, 0))
        if n == 0:
            mean, n = self._all
        return max(1, round(mean)) if n else self.prior
