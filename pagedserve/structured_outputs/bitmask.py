"""Applying the step's grammar bitmask to the logits, for the whole batch at once.

The bitmask is int32 [k, ceil(V / 32)] for the k constrained rows that sample this step
(bit t % 32 of word t // 32 set = token t allowed). Importable without xgrammar: its
kernels (C++ on CPU, CUDA/Triton on GPU) are used when it is installed, else a
byte-lookup-table PyTorch path.
"""

from __future__ import annotations

import numpy as np
import torch

_LUT: dict[torch.device, torch.Tensor] = {}
_xgr_apply = None  # xgrammar.apply_token_bitmask_inplace, once looked up (False: absent)


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(vocab_size / 32)], every token allowed."""
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def _lut(device: torch.device) -> torch.Tensor:
    lut = _LUT.get(device)
    if lut is None:
        b = torch.arange(256, dtype=torch.int32)
        lut = _LUT[device] = ((b.unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
    return lut


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [k, W] -> bool [k, vocab_size] (True = allowed). Little-endian words: byte j
    of the flattened mask holds tokens 8j .. 8j + 7."""
    k = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8).long()
    return _lut(bitmask.device)[as_bytes].view(k, -1)[:, :vocab_size]


def _xgrammar_apply():
    global _xgr_apply
    if _xgr_apply is None:
        try:
            from xgrammar import apply_token_bitmask_inplace

            _xgr_apply = apply_token_bitmask_inplace
        except ImportError:
            _xgr_apply = False
    return _xgr_apply


def apply_grammar_bitmask(logits: torch.Tensor, bitmask, rows: list[int] | None = None) -> None:
    """In place: disallowed tokens of logits row rows[i] (row i if rows is None) get -inf,
    per bitmask row i. Columns past the bitmask's width (a padded vocab) are disallowed."""
    bm = torch.from_numpy(bitmask) if isinstance(bitmask, np.ndarray) else bitmask
    if bm.device != logits.device:
        bm = bm.to(logits.device, non_blocking=True)
    if rows is not None and len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        rows = None
    target = logits if rows is None else logits[rows]  # a copy when rows are picked
    vocab = target.shape[1]
    width = min(vocab, bm.shape[1] * 32)
    if width < vocab:
        target[:, width:] = float("-inf")
    xgr_apply = _xgrammar_apply()
    if xgr_apply and target.dtype == torch.float32 and target.is_contiguous():
        xgr_apply(target, bm, vocab_size=width)
    else:
        target[:, :width].masked_fill_(~bitmask_to_bool(bm, width), float("-inf"))
    if rows is not None:
        logits[rows] = target


def apply_structured_output_bitmask(logits: torch.Tensor, row_req_ids: list[str], sched_out) -> None:
    """Mask logits row j (the request row_req_ids[j]) with the step's bitmask row of that
    request (`sched_out.structured_output_request_ids`), if it has one."""
    ids = sched_out.structured_output_request_ids
    rows, src = [], []
    for j, rid in enumerate(row_req_ids):
        k = ids.get(rid)
        if k is not None:
            rows.append(j)
            src.append(k)
    if not rows:
        return
    bm = sched_out.grammar_bitmask
    if src != list(range(len(bm))):
        bm = bm[src]
    apply_grammar_bitmask(logits, bm, rows)
