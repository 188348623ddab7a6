"""Vectorized sampling over a batch of logits rows (one row per request that samples).

Order, as vLLM: logprobs of the raw model output -> penalties -> greedy argmax, or
temperature -> top-k / top-p -> min-p -> softmax -> sample. Sampling inverts the CDF
with one uniform draw per row (searchsorted over the cumulative probabilities): no host
sync, O(V) cheap work (drawing V exponentials for the exponential-race trick costs ~25x
more on a CPU), and a seeded row draws its number from its own generator, so a seed
reproduces whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.executor import ops


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors ([B] each unless noted)."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor | None = None  # int64; 0 = off
    top_p: torch.Tensor | None = None  # float32; 1 = off
    min_p: torch.Tensor | None = None  # float32; 0 = off
    generators: dict[int, torch.Generator] | None = None  # row -> generator (seeded rows)
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None  # [B, P] int64, padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # [B, O] int64, padded with vocab_size
    max_num_logprobs: int | None = None  # None: no logprobs wanted

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    @property
    def reads_model_dtype(self) -> bool:
        """Whether the sampler can take logits in the model's dtype: greedy and plain
        temperature rows only (the fused kernels read bf16 values exactly); logprobs,
        penalties, top-k / top-p and min-p work on float32 logits."""
        return (
            self.max_num_logprobs is None
            and self.top_k is None
            and self.top_p is None
            and self.min_p is None
            and self.repetition_penalty is None
            and self.output_token_ids is None
        )


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    # When logprobs were asked (of the raw model distribution):
    topk_ids: torch.Tensor | None = None  # [B, k]
    topk_logprobs: torch.Tensor | None = None  # [B, k]
    sampled_logprobs: torch.Tensor | None = None  # [B]
    sampled_ranks: torch.Tensor | None = None  # [B], 1 = most likely


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, N] padded (pad = vocab) -> [B, vocab] occurrence counts."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """OpenAI presence/frequency penalties on output tokens; repetition penalty (as in
    transformers / vLLM) on prompt and output tokens."""
    vocab = logits.shape[1]
    out_counts = token_counts(b.output_token_ids, vocab) if b.output_token_ids is not None else None
    if b.repetition_penalty is not None:
        seen = out_counts > 0 if out_counts is not None else torch.zeros_like(logits, dtype=torch.bool)
        if b.prompt_token_ids is not None:
            seen |= token_counts(b.prompt_token_ids, vocab) > 0
        rp = b.repetition_penalty[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if out_counts is not None:
        if b.frequency_penalty is not None:
            logits = logits - b.frequency_penalty[:, None] * out_counts
        if b.presence_penalty is not None:
            logits = logits - b.presence_penalty[:, None] * (out_counts > 0)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and outside its top-p nucleus.
    The most likely token always survives."""
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if k is not None:
        kk = torch.where(k > 0, k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - kk).unsqueeze(1))  # the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def uniform_draws(
    n: int, generators: dict[int, torch.Generator] | None, device, default: torch.Generator | None = None
) -> torch.Tensor:
    """n numbers in (0, 1]; row i from generators[i] when it has one."""
    u = torch.rand(n, device=device, generator=default)
    if generators:
        for row, g in generators.items():
            u[row] = torch.rand(1, device=device, generator=g)[0]
    return 1.0 - u


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative probability reaches u * total.
    With u > 0 a zero-probability token is never chosen."""
    cdf = probs.cumsum(dim=-1)
    x = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, x).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k=None, top_p=None, min_p=None):
    """The distribution a row samples from: softmax(logits / temperature [B] (> 0)) after
    top-k / top-p and min-p (each [B] or None)."""
    scaled = logits / temperature.unsqueeze(1)
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    return scaled.softmax(dim=-1)


class Sampler:
    """`seed` seeds the generator of rows that have no seed of their own."""

    def __init__(self, seed: int | None = None, device: str | torch.device = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """The fast path of a batch whose rows are all greedy with no penalties or logprobs:
        one row-wise argmax (the fused CPU kernel when it built), no SamplingBatch needed."""
        return ops.argmax(logits)

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        """logits: float32 [B, V] (not modified); or in the model's dtype where
        b.reads_model_dtype, the same tokens (rows the fused kernels cannot take are sampled
        from a float32 copy)."""
        raw_logprobs = logits.log_softmax(dim=-1) if b.max_num_logprobs is not None else None
        if b.repetition_penalty is not None or b.output_token_ids is not None:
            logits = apply_penalties(logits, b)
        is_greedy = b.temperature == 0
        if bool(is_greedy.all()):
            sampled = ops.argmax(logits)
        else:
            temp = torch.where(is_greedy, torch.ones_like(b.temperature), b.temperature)
            u = uniform_draws(logits.shape[0], b.generators, logits.device, self.generator)
            random = None
            if b.top_k is None and b.top_p is None and b.min_p is None:
                # temperature alone (an OpenAI client's default): one fused pass per row
                random = ops.sample_at_temperature(logits, temp, u)
            if random is None:
                probs = sampling_probs(logits.float(), temp, b.top_k, b.top_p, b.min_p)
                random = sample_from_probs(probs, u)
            # the argmax only for greedy rows beside sampled ones (the check syncs: CPU only)
            mixed = logits.device.type != "cpu" or bool(is_greedy.any())
            sampled = torch.where(is_greedy, ops.argmax(logits), random) if mixed else random
        out = SamplerOutput(sampled=sampled)
        if raw_logprobs is not None:
            k = b.max_num_logprobs
            if k > 0:
                out.topk_logprobs, out.topk_ids = raw_logprobs.topk(k, dim=-1)
            lp = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
            out.sampled_logprobs = lp
            out.sampled_ranks = (raw_logprobs > lp.unsqueeze(1)).sum(dim=-1) + 1
        return out


def make_sampling_batch(states, vocab_size: int, device) -> SamplingBatch:
    """The sampling settings of the rows that sample this step, from their request states
    (executor/input_batch.py RequestState: params, generator, prompt and output tokens).
    Host -> device copies happen here, before the forward (no sync after it)."""
    ps = [s.params for s in states]
    b = SamplingBatch(
        temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in ps], dtype=torch.float32, device=device)
    )
    if any(p.top_k > 0 for p in ps):
        b.top_k = torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=device)
    if any(p.top_p < 1.0 for p in ps):
        b.top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device)
    if any(p.min_p > 0.0 for p in ps):
        b.min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device)
    gens = {i: s.generator for i, s in enumerate(states) if s.generator is not None and not s.params.greedy}
    b.generators = gens or None
    if any(p.has_penalties for p in ps):
        if any(p.repetition_penalty != 1.0 for p in ps):
            b.repetition_penalty = torch.tensor([p.repetition_penalty for p in ps], device=device)
            b.prompt_token_ids = _pad([s.prompt_token_ids for s in states], vocab_size, device)
        b.frequency_penalty = torch.tensor([p.frequency_penalty for p in ps], device=device)
        b.presence_penalty = torch.tensor([p.presence_penalty for p in ps], device=device)
        b.output_token_ids = _pad([s.output_token_ids for s in states], vocab_size, device)
    nlp = [p.logprobs for p in ps if p.logprobs is not None]
    b.max_num_logprobs = max(nlp) if nlp else None
    return b


def _pad(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    """Token-id rows padded with `pad` (the vocabulary size: an id no token has)."""
    width = max((len(r) for r in rows), default=0) or 1
    arr = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return torch.from_numpy(arr).to(device)
