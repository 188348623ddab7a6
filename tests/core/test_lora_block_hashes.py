"""Prefix caching keyed by LoRA adapter (issue 33): the chained block hashes of two
adapters (or an adapter and the base model) never match, whatever the tokens and cache
salts; the same adapter's do. And through the KV cache manager: a request of another
adapter gets no prefix hit on blocks it did not compute."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.core.block_pool import extend_block_hashes, hash_block_tokens
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.lora import LoRARequest
from pagedserve.sampling_params import SamplingParams

tokens = st.lists(st.integers(0, 2**31), min_size=4, max_size=40)
salts = st.one_of(st.none(), st.text(min_size=1, max_size=8))
lora_ids = st.integers(0, 2**40)


@settings(max_examples=200, deadline=None)
@given(tokens, tokens, salts, salts, lora_ids, lora_ids)
def test_blocks_of_different_adapters_never_share_a_hash(t1, t2, s1, s2, a, b):
    h1 = set(extend_block_hashes([], t1, 4, s1, lora_id=a))
    h2 = set(extend_block_hashes([], t2, 4, s2, lora_id=b))
    if a != b:
        assert not h1 & h2
    same = extend_block_hashes([], t1, 4, s1, lora_id=a)
    assert set(same) == h1  # the same adapter, tokens and salt: the same chain
    assert hash_block_tokens(None, t1[:4], s1, a) == same[0]


def _req(rid, lora):
    return Request(rid, list(range(100, 140)), SamplingParams(max_tokens=4), max_tokens=4,
                   lora_request=LoRARequest(f"a{lora}", lora, "/x") if lora else None)


def test_prefix_hits_only_within_an_adapter():
    kv = KVCacheManager(num_blocks=32, block_size=8)
    first = _req("r0", 1)
    kv.update_block_hashes(first)
    assert kv.allocate_slots(first, 40) is not None
    kv.free(first)
    for rid, lora, hit in (("same", 1, 32), ("other", 2, 0), ("base", 0, 0)):
        r = _req(rid, lora)
        kv.update_block_hashes(r)
        assert kv.get_computed_blocks(r)[1] == hit, rid
