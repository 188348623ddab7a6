"""The fused elementwise ops of a decoder step on CUDA tensors, in Triton.

The same functions, arguments and in-place contracts as the C++ CPU module
(csrc/fused_ops.cpp), so the model code passes either one as `kern`:
  rms_norm(x, w, eps)                    -> w * norm(x)                      (new tensor)
  add_rms_norm_(x, residual, w, eps)     residual <- x + residual, x <- w * norm(residual)
  rotary_(qkv, cos, sin, nq, nkv, d)     neox rotary on the q and k heads of each fused row
  silu_and_mul(gu)                       -> silu(gate) * up                  (new tensor)
(No rotary_cache_: the Triton attention backend writes its own K/V rows, so the model never
asks for it there.) Each op is one kernel where the PyTorch references (ops/__init__.py) are
three to six: on an H200 the unfused elementwise kernels were about 1.3 ms of a 6.1 ms
batch-1 decode of an 8 B model (BENCHMARKS section 7).

Numerics follow the references' roundings: float32 inside, each value rounded to the model
dtype where eager PyTorch rounds it (the residual sum, the normalized row before the weight,
each rotary product, silu before the multiply). Reductions run in another order, so results
agree to rounding, not to the bit (tests/executor/test_triton_ops.py). Every launch turns off
Triton's multiply-add fusion (LAUNCH_OPTIONS, as the C++ module's -ffp-contract=off): with it
the compiler makes each rotary product a multiply fused into the sum (fma.rn.bf16 in the sm90
PTX of Triton 3.9), dropping that product's rounding; the likely cause of an H200's (Triton
3.6) 2-3% of bf16 rotary outputs a step of the products off eager's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LAUNCH_OPTIONS = {"enable_fp_fusion": False}  # every launch here (tests/executor/test_triton_compile.py)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, sx, sr, so, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
    if ADD:  # the residual sum, rounded to the dtype as eager's add (bf16 + bf16 in float32)
        r = tl.load(res_ptr + row * sr + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * sr + offs, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, axis=0) / n + eps))
    y = (xf * inv).to(x.dtype).to(tl.float32)  # the normalized row in the dtype, then the weight
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + offs, (w * y).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotary_kernel(
    qkv_ptr, cos_ptr, sin_ptr, s_row, nrot, D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_J)
    jm = j < HALF
    m = (h < nrot)[:, None] & jm[None, :]
    first = qkv_ptr + t * s_row + h[:, None] * D + j[None, :]
    x1 = tl.load(first, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * D + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * D + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * D + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * D + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    dt = qkv_ptr.dtype.element_ty
    # eager: x * cos + rotate_half(x) * sin, each product rounded to the dtype, then the sum
    a1, b1 = (x1 * c1).to(dt).to(tl.float32), (-x2 * s1).to(dt).to(tl.float32)
    a2, b2 = (x2 * c2).to(dt).to(tl.float32), (x1 * s2).to(dt).to(tl.float32)
    tl.store(first, (a1 + b1).to(dt), mask=m)
    tl.store(first + HALF, (a2 + b2).to(dt), mask=m)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, sg, so, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < inter
    g = tl.load(gu_ptr + t * sg + j, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * sg + inter + j, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu(gate) in the dtype, then * up
    tl.store(out_ptr + t * so + j, (act * u).to(dt), mask=m)


def _rows(t: torch.Tensor, name: str) -> None:
    if not (t.dim() == 2 and t.stride(1) == 1):
        raise RuntimeError(f"{name}: a [rows, n] tensor with unit inner stride")


def _norm(x, residual, weight, out, eps: float) -> None:
    n = x.shape[1]
    if not (weight.is_contiguous() and weight.numel() == n and weight.dtype == x.dtype):
        raise RuntimeError("weight: contiguous [n], the rows' dtype")
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, n, x.stride(0), res.stride(0), out.stride(0), float(eps),
        ADD=residual is not None, BLOCK=block, num_warps=min(16, max(4, block // 1024)), **LAUNCH_OPTIONS,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, n] (unit inner stride), weight [n] of x's dtype -> a new [rows, n]:
    weight * (x / sqrt(mean(x^2) + eps)), the normalized row rounded to the dtype first."""
    _rows(x, "x")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, None, weight, out, eps)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, row by row: residual <- x + residual (rounded to the dtype), then
    x <- rms_norm(residual). x and residual: the same shape and dtype, not overlapping."""
    _rows(x, "x")
    _rows(residual, "residual")
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise RuntimeError("x and residual: the same shape and dtype")
    _norm(x, residual, weight, x, eps)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int, d: int) -> None:
    """In place on the first nq + nkv heads (q, then k) of each fused row of qkv [T, >= (nq + 2
    nkv) * d]: neox rotary x * cos + rotate_half(x) * sin with cos / sin contiguous [T, d] of
    qkv's dtype; the V heads and anything past them are left as they are."""
    _rows(qkv, "qkv")
    t = qkv.shape[0]
    if qkv.shape[1] < (nq + 2 * nkv) * d or d % 2:
        raise RuntimeError("qkv row too short for the heads, or an odd head_dim")
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.numel() == t * d == sin.numel()):
        raise RuntimeError("cos/sin: contiguous [T, head_dim]")
    if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise RuntimeError("cos/sin: qkv's dtype")
    nrot = nq + nkv
    _rotary_kernel[(t,)](
        qkv, cos, sin, qkv.stride(0), nrot, D=d, HALF=d // 2, BLOCK_H=triton.next_power_of_2(nrot),
        BLOCK_J=triton.next_power_of_2(d // 2), **LAUNCH_OPTIONS,
    )


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (gate, then up) -> a new [T, I]: silu(gate), rounded to the dtype, times up."""
    _rows(gu, "gate_up")
    if gu.shape[1] % 2:
        raise RuntimeError("gate_up: even width")
    inter = gu.shape[1] // 2
    out = torch.empty((gu.shape[0], inter), dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](
        gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block, **LAUNCH_OPTIONS
    )
    return out
