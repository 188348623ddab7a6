"""The hybrid KV cache manager (KV cache groups, sliding windows) under the real scheduler.

A fake runner keeps a simulated physical KV cache (what each block's slots hold: which
group wrote which token) and, every step, checks that every position each query can see
through each group's window (every earlier position for a full-attention group) reads
back the right token through that group's block table: a block given back too early, a
wrong prefix hit, or two tables sharing a block they both write would show here. Beside
it the invariants: ref counts = the (request, group) tables holding a block; a sliding
group's entries are null exactly before its released mark, which no query can still see;
nothing leaks after aborts and preemptions.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.kv_cache_manager import HybridKVCacheManager, KVCacheManager, make_kv_cache_manager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.executor.kv_cache import kv_cache_layout
from pagedserve.executor.model_config import ModelConfig
from pagedserve.messages import ModelRunnerOutput
from pagedserve.sampling_params import SamplingParams
from tests.fake_model import FakeRunner, next_token, reference_output


class WindowedKVRunner:
    """Reads and writes a simulated paged cache through each group's block table."""

    def __init__(self, windows, block_size):
        self.windows, self.bs, self.G = tuple(windows), block_size, len(windows)
        self.cache: dict[int, list] = {}  # block id -> per slot (group, token)
        self.tokens: dict[str, list[int]] = {}
        self.flat: dict[str, list[int]] = {}

    def table(self, rid, g):
        return self.flat[rid][g :: self.G]

    def execute(self, so):
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(rid, None)
            self.flat.pop(rid, None)
        sampled = {}
        for sr in so.scheduled:
            if sr.is_new:
                self.tokens[sr.req_id] = (list(sr.prompt_token_ids) + list(sr.output_token_ids))[: sr.num_computed_tokens]
                self.flat[sr.req_id] = list(sr.block_ids)
            else:
                self.flat[sr.req_id].extend(sr.block_ids)
            toks = self.tokens[sr.req_id]
            assert len(toks) == sr.num_computed_tokens
            start = len(toks)
            toks.extend(sr.token_ids)
            tables = [self.table(sr.req_id, g) for g in range(self.G)]
            for p in range(start, len(toks)):  # every layer writes its K/V before attention reads
                for g in range(self.G):
                    b = tables[g][p // self.bs]
                    assert b != 0, (sr.req_id, g, p)
                    self.cache.setdefault(b, [None] * self.bs)[p % self.bs] = (g, toks[p])
            for q in range(start, len(toks)):
                for g, w in enumerate(self.windows):
                    for p in range(0 if w is None else max(0, q - w + 1), q + 1):
                        b = tables[g][p // self.bs]
                        assert self.cache.get(b, [None] * self.bs)[p % self.bs] == (g, toks[p]), (sr.req_id, g, q, p)
            if sr.sample:
                sampled[sr.req_id] = next_token(toks)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def check_hybrid_invariants(s: Scheduler):
    kv = s.kv
    pool = kv.pool
    holders = Counter(b.block_id for tables in kv.tables.values() for t in tables for b in t if b.block_id)
    free_ids = set(pool.free_queue.block_ids())
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders.get(b.block_id, 0), b  # ref count = the (request, group) tables holding it
        assert (b.ref_cnt == 0) == (b.block_id in free_ids), b
    for h, b in pool.cached_blocks.items():
        assert b.block_hash == h
    assert set(kv.tables) <= {r.request_id for r in s.running}
    for r in s.running:
        tables = kv.tables[r.request_id]
        n = -(-r.num_computed_tokens // kv.block_size)
        for g, (t, w) in enumerate(zip(tables, kv.windows)):
            assert len(t) == n
            rel = kv.released[r.request_id][g]
            assert [b.block_id == 0 for b in t] == [j < rel for j in range(n)]  # null iff released
            if w is not None:  # released blocks are wholly before the next query's window
                assert rel <= max(0, r.num_computed_tokens - w + 1) // kv.block_size


def make(windows, num_blocks, block_size, budget, caching=True, max_num_seqs=8, max_model_len=4096):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
        kv_cache_groups=windows,
    )


def req(rid, prompt, max_tokens):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 30), st.integers(0, 2)),
            st.tuples(st.just("step"), st.integers(1, 4)),
            st.tuples(st.just("abort"), st.integers(0, 50)),
        ),
        min_size=8,
        max_size=30,
    ),
    windows=st.sampled_from([(None, 5, 5), (None, 20), (3,), (None, 9, 9, 9, 9, 9)]),
    block_size=st.sampled_from([8, 16]),
    num_blocks=st.integers(16, 60),
    budget=st.sampled_from([8, 32, 128]),
    caching=st.booleans(),
)
def test_random_ops_keep_hybrid_invariants_and_kv_contents(ops, windows, block_size, num_blocks, budget, caching):
    s = make(windows, num_blocks, block_size, budget, caching)
    assert isinstance(s.kv, HybridKVCacheManager)
    runner = WindowedKVRunner(windows, block_size)
    added, outs, n = {}, {}, 0

    def step():
        so = s.schedule()
        for o in s.update_from_output(so, runner.execute(so)):
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
        check_hybrid_invariants(s)

    for op in ops:
        if op[0] == "add":
            _, plen, mtok, family = op
            prompt = [family * 1000 + j for j in range(plen)]  # shared prefixes within a family
            r = req(f"q{n}", prompt, mtok)
            n += 1
            try:
                s.add_request(r)
                added[r.request_id] = (prompt, mtok)
            except ValueError:
                assert s.kv.blocks_held_at(plen + mtok - 1) > num_blocks - 1
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        else:
            ids = sorted(s.requests)
            if ids:
                rid = ids[op[1] % len(ids)]
                s.abort_requests([rid])
                added.pop(rid)
                check_hybrid_invariants(s)
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            break
        step()
    for rid, (prompt, mtok) in added.items():
        assert outs.get(rid) == reference_output(prompt, mtok)
    assert s.kv.num_used_blocks == 0 and not s.kv.tables  # no leak after aborts and preemptions
    assert s.kv.pool.num_free_blocks == num_blocks - 1


def test_sliding_blocks_go_back_as_the_window_moves_and_prefix_hits_skip_them():
    """Window 16, blocks of 8: a decoding request holds at most 3 sliding blocks; a later
    request with the same prompt hits every full-attention block and only the sliding
    blocks its first query sees (the others null, never revived)."""
    bs, w = 8, 16
    s = make((None, w), 64, bs, 64)
    runner = WindowedKVRunner((None, w), bs)
    prompt = list(range(60))
    s.add_request(req("a", prompt, 10))
    held = []
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, runner.execute(so))
        check_hybrid_invariants(s)
        if "a" in s.kv.tables:
            tables = s.kv.tables["a"]
            held.append((len(tables[0]), sum(b.block_id != 0 for b in tables[1])))
    assert held[0] == (8, 8)  # the prompt's step: every block written
    assert all(sliding <= 3 for _, sliding in held[1:])  # then the window's (16 tokens + the next)
    assert held[-1][0] == 9
    b = req("b", prompt + [99], 3)
    hits, n = s.kv.get_computed_blocks(b)
    assert n == 56 and len(hits) == 14  # 7 blocks x 2 groups
    sliding = hits[1::2]
    first = (56 - w + 1) // bs  # the first block the query at 56 sees
    assert [x.block_id == 0 for x in sliding] == [j < first for j in range(7)]
    s.add_request(b)
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, runner.execute(so))
        check_hybrid_invariants(s)
    assert s.kv.num_used_blocks == 0


def test_factory_and_capacity():
    assert type(make_kv_cache_manager(10, 4)) is KVCacheManager
    assert type(make_kv_cache_manager(10, 4, True, (None,))) is KVCacheManager
    kv = make_kv_cache_manager(101, 16, True, (None, 64, 64), max_num_batched_tokens=32)
    assert kv.blocks_held_at(160) == 10 + 2 * 7  # sliding: cdiv(63 + 32, 16) + 1 = 7 blocks
    assert kv.request_capacity_blocks == 100 - 14  # n + 14 <= 100
    assert make_kv_cache_manager(11, 16, True, (64,), 32).request_capacity_blocks > 10**6  # windows only


def test_gemma3_shaped_kv_bytes_at_8k_context():
    """A Gemma-3-shaped model (5 local : 1 global, window 1024) at 8k tokens of context holds
    <= 0.3x the KV bytes of the full-attention layout (every layer every block), measured
    on the manager's pool while the request decodes (prompt prefilled in 2k chunks)."""
    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_hidden_layers": 6,
            "vocab_size": 300,
            "sliding_window": 1024,
            "max_position_embeddings": 32768,
        }
    )
    lay = kv_cache_layout(cfg)
    assert lay.windows == (None,) + (1024,) * 5 and lay.num_slots == 1
    bs = 16
    s = make(lay.windows, 6 * 8400 // bs + 1, bs, 2048, caching=False, max_model_len=8400)
    runner = FakeRunner(block_size=bs)
    s.add_request(req("r", list(range(8192)), 16))
    peak_decode = 0
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, runner.execute(so))
        if so.num_scheduled_tokens == 1:
            peak_decode = max(peak_decode, s.kv.num_used_blocks)
    full_layout = 6 * -(-(8192 + 15) // bs)  # layer-blocks of every layer at full length
    ratio = peak_decode * lay.num_slots / full_layout
    assert ratio <= 0.3, ratio
    assert peak_decode == -(-(8192 + 15) // bs) + 5 * (1024 // bs + 1)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_and_abort_with_groups(caching):
    """A pool too small for four growing requests: preemptions recompute through the hybrid
    tables (contents checked every step), an abort mid-run frees every group's blocks."""
    windows, bs = (None, 8, 8), 8
    s = make(windows, 30, bs, 64, caching)
    runner = WindowedKVRunner(windows, bs)
    prompts = {f"r{i}": [i % 2 * 500 + j for j in range(30)] for i in range(5)}
    for rid, p in prompts.items():
        s.add_request(req(rid, p, 30))
    outs, step = {}, 0
    while s.has_unfinished_requests():
        so = s.schedule()
        for o in s.update_from_output(so, runner.execute(so)):
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
        check_hybrid_invariants(s)
        step += 1
        if step == 12 and "r4" in s.requests:
            s.abort_requests(["r4"])
            prompts.pop("r4")
            check_hybrid_invariants(s)
    assert s.num_preemptions > 0
    for rid, p in prompts.items():
        assert outs[rid] == reference_output(p, 30)
    assert s.kv.num_used_blocks == 0 and s.kv.pool.num_free_blocks == 29
