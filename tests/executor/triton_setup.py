"""Imported first by the Triton test modules: on a machine without CUDA the kernels run under
Triton's interpreter (TRITON_INTERPRET=1, set before triton decorates them); with neither a GPU
nor Triton the importing module is skipped. DEV: where the tensors go; INTERPRETED: whether
the kernels are interpreted (its roundings differ: see test_triton_ops.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a GPU", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
