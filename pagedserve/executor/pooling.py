"""Pooling (embedding) models: how a prompt's hidden states become one vector.

`resolve_pooler` decides, in this order: the engine arguments (`pooling_type`,
`pooling_normalize`), the model's own sentence-transformers files (`modules.json` with a
`1_Pooling/config.json` and optionally a Normalize module), else last-token pooling,
normalized (what decoder embedding models such as Qwen3-Embedding and gte-Qwen2 use).
Matryoshka truncation (`dimensions`) is allowed where config.json says so
(`is_matryoshka` or `matryoshka_dimensions`).

`Pooler` keeps, per request, what its pooling needs across prefill chunks (the running
sum and count for mean, the first position for CLS, nothing for last) and gives the
vector when the prompt's last chunk has run. Hidden states are the model's final-norm
outputs (transformers' `last_hidden_state`); the math runs in float32.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka_dims: tuple[int, ...] | None = None  # () : any size up to hidden_size; None: none

    def check_dimensions(self, dims: int | None) -> None:
        """ValueError naming `dimensions` unless the model supports that truncation."""
        if dims is None:
            return
        from pagedserve.errors import InvalidRequestError

        if self.matryoshka_dims is None:
            raise InvalidRequestError("this model does not support Matryoshka dimensions.", "dimensions")
        ok = dims <= self.hidden_size if not self.matryoshka_dims else dims in self.matryoshka_dims
        if not ok:
            allowed = list(self.matryoshka_dims) or f"1..{self.hidden_size}"
            raise InvalidRequestError(f"dimensions must be one of {allowed}, got {dims}.", "dimensions")


def resolve_pooler(model_dir: str, hf_config: dict, pooling_type: str | None, normalize: bool | None) -> PoolerConfig:
    st_type, st_norm = _sentence_transformers_pooling(model_dir)
    kind = pooling_type or st_type or "last"
    norm = normalize if normalize is not None else (st_norm if st_type is not None else True)
    dims = None
    if hf_config.get("matryoshka_dimensions"):
        dims = tuple(int(d) for d in hf_config["matryoshka_dimensions"])
    elif hf_config.get("is_matryoshka"):
        dims = ()
    return PoolerConfig(kind, norm, int(hf_config.get("hidden_size", 0)), dims)


def _sentence_transformers_pooling(model_dir: str) -> tuple[str | None, bool]:
    """(pooling type, normalize) from modules.json and its Pooling module's config, or
    (None, False) when the model ships none."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None, False
    with open(path) as f:
        modules = json.load(f)
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    pool = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pool is None:
        return None, normalize
    with open(os.path.join(model_dir, pool.get("path", "1_Pooling"), "config.json")) as f:
        cfg = json.load(f)
    for key, kind in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls")):
        if cfg.get(key):
            return kind, normalize
    raise ValueError(f"{pool.get('path', '1_Pooling')}/config.json: no supported pooling mode (last token, mean, CLS).")


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._sum: dict[str, torch.Tensor] = {}
        self._count: dict[str, int] = {}
        self._first: dict[str, torch.Tensor] = {}

    def add_chunk(self, req_id: str, hidden: torch.Tensor, first_position: int) -> None:
        """One prefill chunk's hidden states [n, H] of the request, from `first_position`."""
        kind = self.config.pooling_type
        if kind == "mean":
            h = hidden.float().sum(0)
            self._sum[req_id] = self._sum[req_id] + h if req_id in self._sum else h
            self._count[req_id] = self._count.get(req_id, 0) + hidden.shape[0]
        elif kind == "cls" and first_position == 0:
            self._first[req_id] = hidden[0].float()

    def finish(self, req_id: str, last_hidden: torch.Tensor, dimensions: int | None, normalize: bool | None) -> list[float]:
        """The request's vector (its last chunk added); forgets the request."""
        kind = self.config.pooling_type
        if kind == "mean":
            v = self._sum.pop(req_id) / self._count.pop(req_id)
        elif kind == "cls":
            v = self._first.pop(req_id)
        else:
            v = last_hidden.float()
        if dimensions is not None:
            v = v[:dimensions]
        if self.config.normalize if normalize is None else normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        return v.tolist()

    def forget(self, req_id: str) -> None:
        for d in (self._sum, self._count, self._first):
            d.pop(req_id, None)
