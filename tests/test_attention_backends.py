"""The C++ decode kernel against the PyTorch reference backend."""

import pytest
import torch

from pagedserve.executor.attention import cpu_kernels
from pagedserve.executor.attention.backend import AttentionMetadata
from pagedserve.executor.attention.torch_backend import TorchAttentionBackend

kernels = cpu_kernels.load()


@pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 64), (8, 2, 64), (8, 1, 128), (9, 3, 64)])
def test_cpp_decode_matches_reference(dtype, tol, bs, heads, kv_heads, d):
    g = torch.Generator().manual_seed(bs * 100 + heads)
    n, nb = 7, 64
    kc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    lens = torch.tensor([1, bs - 1, bs, bs + 1, 3 * bs + 5, 5 * bs, 2])  # across block boundaries
    nblk = int((lens.max() + bs - 1) // bs)
    bt = torch.stack([torch.randperm(nb - 1, generator=g)[:nblk] + 1 for _ in range(n)])
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    meta = AttentionMetadata(n, n, None, lens, bt, None, 1, int(lens.max()), int(lens.max()), None, None)
    ref = TorchAttentionBackend._decode(q, kc, vc, meta, d**-0.5)
    out = kernels.paged_decode(q, kc, vc, bt, lens, d**-0.5)
    assert (out.float() - ref.float()).abs().max().item() < tol
