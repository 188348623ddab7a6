"""The CPU KV cache's memory: zeroed, committed page by page as blocks are first written."""

import sys

import pytest
import torch

from pagedserve.executor.kv_cache import lazy_zeros


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazy_zeros_is_a_zeroed_writable_tensor(dtype):
    t = lazy_zeros((5, 16, 3, 8), dtype)
    assert t.shape == (5, 16, 3, 8) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[2, 3] = 1.5
    assert t.sum().item() == 1.5 * 24
    assert lazy_zeros((0, 16), dtype).shape == (0, 16)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_lazy_zeros_commits_only_what_is_written():
    """1 GiB reserved; writing 8 MiB of it commits ~8 MiB (base pages, not 2 MiB huge pages
    per touched region)."""
    before = _rss_bytes()
    t = lazy_zeros((1 << 28,), torch.float32)
    assert _rss_bytes() - before < (16 << 20)
    stride = 1 << 20  # one float every 4 MiB: 256 pages touched
    t[::stride] = 1.0
    grown = _rss_bytes() - before
    assert grown < (64 << 20), f"RSS grew {grown >> 20} MiB for 256 touched pages"
    del t


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_committed_zeros_are_resident_at_once():
    """kv_cache_prefault: 256 MiB committed when allocated (MADV_POPULATE_WRITE, or a write per
    page), still zeroed and writable."""
    before = _rss_bytes()
    t = lazy_zeros((1 << 26,), torch.float32, commit=True)
    grown = _rss_bytes() - before
    assert grown >= (240 << 20), f"RSS grew only {grown >> 20} MiB"
    assert not t[:: 1 << 16].any()
    t[5] = 2.0
    assert t[5].item() == 2.0
    del t


@pytest.mark.parametrize("prefault", [False, True])
def test_prefault_setting_reaches_the_cache(monkeypatch, checkpoint, prefault):
    """kv_cache_prefault reaches the runner's allocation: every K/V tensor committed or none."""
    from pagedserve.executor import kv_cache
    from pagedserve.frontend.llm import LLM

    seen = []
    real = kv_cache.lazy_zeros
    monkeypatch.setattr(kv_cache, "lazy_zeros", lambda s, d, commit=False: seen.append(commit) or real(s, d, commit))
    llm = LLM(checkpoint("llama"), num_kv_blocks=8, kv_cache_prefault=prefault)
    llm.shutdown()
    assert seen and all(c == prefault for c in seen)


def test_prefault_default_is_lazy_offline_and_committed_for_a_server(monkeypatch, checkpoint):
    """Left unset (None): `LLM` commits page by page, a server's AsyncLLM at start."""
    from pagedserve.engine.async_engine import AsyncLLM
    from pagedserve.engine_args import EngineArgs
    from pagedserve.executor import kv_cache
    from pagedserve.frontend.llm import LLM

    seen = []
    real = kv_cache.lazy_zeros
    monkeypatch.setattr(kv_cache, "lazy_zeros", lambda s, d, commit=False: seen.append(commit) or real(s, d, commit))
    LLM(checkpoint("llama"), num_kv_blocks=8).shutdown()
    offline, seen[:] = list(seen), []
    AsyncLLM.from_engine_args(EngineArgs(model=checkpoint("llama"), num_kv_blocks=8, engine_core_process=False)).shutdown()
    assert offline and not any(offline)
    assert seen and all(seen)
