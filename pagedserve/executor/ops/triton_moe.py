"""Mixture-of-experts products on CUDA in Triton, in fixed shapes so that CUDA graphs capture them.

The CPU path (models/moe.py: FusedExperts) sorts a step's (token, choice) pairs by expert and
runs each active expert over its rows, reading the row counts on the host; a CUDA graph cannot
(the counts are data: capture fails on the copy). Here, as vLLM's fused_moe does:
  * `align` lays the pairs out expert by expert, each expert's run padded to a multiple of
    BLOCK_M rows with the pair index T*k (no pair), in a buffer whose size depends on T only;
    every block of BLOCK_M rows belongs to one expert (`block_expert`); `used` [1] counts the
    rows in use, all on the device;
  * `grouped_mm` runs one program per (block of rows, BLOCK_N columns): it reads its expert's
    weights, gathers its rows' inputs by pair, and writes each pair's output row; programs past
    `used` return at once, padding rows are neither read nor written.
So each active expert's weights are read once per block of its rows, idle experts not at all.

Numerics: float32 sums (IEEE products for float32 inputs, no TF32), each product's output
rounded to the dtype once, as F.linear (up to the order of the sums): the experts' outputs are
then weighted and summed by the caller exactly as on the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.executor.ops.triton_ops import LAUNCH_OPTIONS


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows a program takes: about the pairs an expert gets (16 at decode, up to 64 at prefill)."""
    per_expert = -(-num_pairs // num_experts)
    return min(64, max(16, triton.next_power_of_2(per_expert)))


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] (expert of each (token, choice) pair) -> (pairs, block_expert, used):
    pairs [P] int64, the pair indices t*k + j grouped by expert in increasing expert order,
    stable within an expert, each expert's run padded with T*k to a multiple of block_m;
    block_expert [P / block_m] int64, the expert of each block (clamped past `used`);
    used [1] int64, the rows of `pairs` in use. P = T*k + min(E, T*k) * (block_m - 1), rounded
    up to block_m: a bound that depends on T alone. No host synchronisation."""
    n, dev = ids.numel(), ids.device
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # each expert's run ends here
    order = torch.argsort(flat, stable=True)  # pairs by expert
    expert_of = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    dest = (ends - padded)[expert_of] + torch.arange(n, device=dev) - first[expert_of]
    size = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((size,), n, dtype=torch.long, device=dev).scatter_(0, dest, order)
    starts = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return pairs, block_expert, ends[-1:]


@triton.jit(do_not_specialize=["num_pairs"])  # T * k varies per step
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, pairs_ptr, block_expert_ptr, used_ptr,
    num_pairs, N, K, sa, sbe, sbn, sc,
    ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // ROW_DIV  # the input row of each pair: its token (ROW_DIV = k), or the pair (1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * sa + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            b_ptr + e * sbe + offs_n[None, :] * sbn + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N] of the expert's [N, K] weight
        if IEEE:  # exact float32 (no tf32)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    out = c_ptr + pairs[:, None] * sc + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def grouped_mm(
    a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor, used: torch.Tensor,
    row_div: int, num_pairs: int, block_m: int,
) -> torch.Tensor:  # fmt: skip
    """out [num_pairs, N]: row p = a[p // row_div] @ w[expert of p].T, for the pairs `align`
    laid out; a [rows, K] with unit inner stride, w [E, N, K] contiguous, of a's dtype."""
    if a.stride(1) != 1 or not w.is_contiguous() or w.dtype != a.dtype or w.shape[2] != a.shape[1]:
        raise RuntimeError("grouped_mm: a [rows, K] (unit inner stride), w [E, N, K] contiguous, the same dtype")
    n, k = w.shape[1], w.shape[2]
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    ieee = a.dtype == torch.float32
    bn, bk = 64, 32 if ieee else 64
    grid = (pairs.numel() // block_m, triton.cdiv(n, bn))
    _grouped_mm_kernel[grid](
        a, w, out, pairs, block_expert, used, num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROW_DIV=row_div, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, **LAUNCH_OPTIONS,
    )  # fmt: skip
    return out


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, act) -> torch.Tensor:
    """x [T, H], stacked experts w13 [E, 2I, H] and w2 [E, H, I], ids [T, k] -> [T, k, H]: the
    output of each token's k chosen experts, w2 @ act(w13 @ x) with `act` [rows, 2I] -> [rows, I]."""
    t, k = ids.shape
    e = w13.shape[0]
    if t == 0:  # no rows (a pooling step's kept rows can be none): no launch of an empty grid
        return x.new_empty((0, k, w2.shape[1]))
    bm = block_m_for(t * k, e)
    pairs, block_expert, used = align(ids, e, bm)
    gate_up = grouped_mm(x, w13, pairs, block_expert, used, k, t * k, bm)
    return grouped_mm(act(gate_up), w2, pairs, block_expert, used, 1, t * k, bm).view(t, k, -1)
