"""Data parallelism: two engine cores behind one server (engine/dp_client.py), routed by
prompt prefix (engine/dp_router.py). Replica 1 is made slower than replica 0 (it sleeps
after every step), so every end-to-end test also checks that a slow replica loses nothing."""

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from pagedserve.core.request import Request  # noqa: E402
from pagedserve.engine.dp_client import merge_stats  # noqa: E402
from pagedserve.engine.dp_router import ADAPTER, LOAD, PREFIX, ROUND_ROBIN, DPRouter  # noqa: E402
from pagedserve.errors import EngineDeadError  # noqa: E402
from pagedserve.messages import EngineStats  # noqa: E402
from tests.server.test_server import MODEL, Server  # noqa: E402

ENGINE_KW = dict(dtype="float32", num_kv_blocks=300, max_model_len=512)
BS = 16


# -- the router alone ---------------------------------------------------------------------
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_router_hashes_are_the_kv_cache_managers(salt):
    toks = list(range(3, 3 + 5 * BS + 7))
    req = Request("r", toks, SamplingParams(), cache_salt=salt)
    KVCacheManager(10, BS).update_block_hashes(req)
    assert len(req.block_hashes) == 5
    assert DPRouter(2, BS).block_hashes(toks, salt) == req.block_hashes
    assert DPRouter(2, BS, max_prefix_blocks=3).block_hashes(toks, salt) == req.block_hashes[:3]


def test_router_prefix_then_least_loaded_then_balance():
    r = DPRouter(3, BS, balance_slack=2)
    a, b = [1] * (4 * BS), [2] * (4 * BS)
    first, why = r.route(a + [9], None, [5, 0, 3])
    assert (first, why) == (1, LOAD)  # nothing known: the least loaded
    assert r.route(a + [8, 7], None, [5, 1, 3]) == (1, PREFIX)  # same 4 blocks, other suffix
    assert r.route(a[: 2 * BS] + b, None, [5, 1, 3]) == (1, PREFIX)  # a 2-block match still counts
    assert r.route(b, None, [0, 9, 0])[1] == LOAD  # busier than the least loaded + slack: balance
    assert r.route(a, "salted", [0, 0, 0])[1] == LOAD  # another cache salt: another cache
    assert r.route([1] * (BS - 1), None, [0, 0, 0])[1] == LOAD  # under one block: nothing to match
    # ties among the least loaded go round, so short prompts spread
    assert {r.route([5], None, [0, 0, 0])[0] for _ in range(3)} == {0, 1, 2}
    r.forget()
    assert r.route(a, None, [3, 3, 0]) == (2, LOAD)


def test_router_keeps_an_adapters_requests_together():
    r = DPRouter(2, BS, balance_slack=2)
    assert r.route([3], None, [1, 0], lora_id=7) == (1, LOAD)  # first of adapter 7: the least loaded
    assert r.route([4], None, [0, 1], lora_id=7) == (1, ADAPTER)  # then where its weights are
    assert r.route([5], None, [0, 1], lora_id=8) == (0, LOAD)  # another adapter: its own home
    assert r.route([6], None, [0, 3], lora_id=7) == (0, LOAD)  # home busier than least + slack: balance
    assert r.route([6], None, [0, 0], lora_id=7) == (0, ADAPTER)  # ... and the home moved with it
    assert r.route([6], None, [0, 0])[1] == LOAD  # the base model: no home
    r.unavailable.add(0)
    assert r.route([6], None, [0, 0], lora_id=7)[1] != ADAPTER  # a dead home is not used


def test_router_lru_is_bounded_and_round_robin_ignores_prompts():
    r = DPRouter(2, BS, max_entries=8)
    for i in range(10):
        r.route([i] * (4 * BS), None, [0, 0])
    assert len(r.owner) == 8
    rr = DPRouter(2, BS, "round_robin")
    assert [rr.route([1] * (4 * BS), None, [9, 0]) for _ in range(3)] == [
        (0, ROUND_ROBIN),
        (1, ROUND_ROBIN),
        (0, ROUND_ROBIN),
    ]


def test_merge_stats_sums_counters_and_recomputes_ratios():
    def st(used, total, util, hits, per_pos):
        return EngineStats(
            1, 2, total, used, used / total, util, 0, 10, 20, 40, hits, 3, 30, 1, 8, BS,
            spec_accepted_per_position=per_pos,
        )  # fmt: skip

    m = merge_stats([st(10, 100, 0.5, 16, [1, 2]), st(30, 100, 1.0, 32, [3])])
    assert (m.num_running, m.num_waiting, m.kv_blocks_used, m.kv_blocks_total) == (2, 4, 40, 200)
    assert m.kv_cache_usage == pytest.approx(0.2) and m.kv_utilization == pytest.approx(0.875)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.block_size) == (80, 48, BS)
    assert m.spec_accepted_per_position == [4, 2]


# -- two replicas behind one server --------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    os.environ["PAGEDSERVE_TEST_SLOW_ENGINE"] = "1:0.02"  # replica 1: +20 ms per step
    try:
        s = Server(model_dir, engine_kw={**ENGINE_KW, "data_parallel_size": 2})
    finally:
        del os.environ["PAGEDSERVE_TEST_SLOW_ENGINE"]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, **ENGINE_KW)  # one engine, in this process: the reference


def on_server_loop(server, coro, timeout=60):
    """Run a coroutine on the server's event loop (where the AsyncLLM lives)."""
    return asyncio.run_coroutine_threadsafe(coro, server.async_llm._loop).result(timeout)


def metrics(url) -> str:
    return httpx.get(url + "/metrics").text


def complete(url, prompts, max_tokens=12):
    async def one(ac, p):
        body = {"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = await ac.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
            return await asyncio.gather(*[one(ac, p) for p in prompts])

    return asyncio.run(main())


def test_32_concurrent_requests_match_one_engine(server, offline):
    prompts = [f"Request number {i}: the quick brown fox" for i in range(32)]
    refs = offline.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert complete(server.url, prompts) == [r.outputs[0].text for r in refs]
    reps = server.async_llm.replicas
    per_engine = [sum(v for (i, _), v in reps.routed.items() if i == e) for e in (0, 1)]
    assert sum(per_engine) == 32 and min(per_engine) > 0, per_engine  # both replicas served
    assert all(s.prompt_tokens > 0 for s in reps.stats)
    assert reps.loads == [0, 0] and reps.holder == {}


def test_shared_prefixes_land_on_one_replica_and_hit_its_cache(server):
    llm = server.async_llm
    llm.reset_prefix_cache()
    time.sleep(0.2)
    before = llm.stats.prefix_cache_hits
    routed_before = dict(llm.replicas.routed)
    groups, per_group, blocks = 4, 4, 4
    leaders, followers = [], []
    for g in range(groups):  # a 4-block system prompt per group, then a question
        system = [10 + g * blocks * BS + k for k in range(blocks * BS)]  # token ids
        leaders.append(system + [7, 8 + g])
        followers += [system + [7 + q, 8 + g] for q in range(1, per_group)]
    # The leaders run first, so their blocks are cached when the followers come; the
    # followers then come at once. The fast replica may drain its share while the slow
    # one still holds its own, and the load balance (tested on the router alone above)
    # would then split a group: the slack is lifted here so that only prefixes decide.
    router = llm.replicas.router
    slack, router.balance_slack = router.balance_slack, 1 << 20
    try:
        for p in leaders:
            complete(server.url, [p], max_tokens=4)
        complete(server.url, followers, max_tokens=4)
    finally:
        router.balance_slack = slack
    new = {k: v - routed_before.get(k, 0) for k, v in llm.replicas.routed.items()}
    assert sum(v for (_, why), v in new.items() if why == PREFIX) == groups * (per_group - 1)
    # every follower found the whole system prompt cached: as many hits as one engine gets
    assert llm.stats.prefix_cache_hits - before == groups * (per_group - 1) * blocks * BS
    text = metrics(server.url)
    assert re.search(
        r'pagedserve:dp_routed_requests_total\{engine="\d",model_name="tiny",reason="prefix"\}', text
    )


def test_metrics_label_both_engines_and_sum_counters(server):
    text = metrics(server.url)
    for name in ("num_requests_running", "kv_blocks_used", "kv_blocks_total", "kv_cache_usage_perc"):
        for e in ("0", "1"):
            assert re.search(rf'^pagedserve:{name}\{{engine="{e}",model_name="tiny"\}} ', text, re.M), (
                name,
                e,
            )
    blocks = [
        float(v) for v in re.findall(r'^pagedserve:kv_blocks_total\{engine="\d".*\} (\S+)$', text, re.M)
    ]
    assert blocks == [s.kv_blocks_total for s in server.async_llm.replicas.stats] and min(blocks) > 0
    assert sum(blocks) == server.async_llm.stats.kv_blocks_total
    gen = float(re.search(r"^pagedserve:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))
    assert gen == sum(s.generation_tokens for s in server.async_llm.replicas.stats) > 0
    assert httpx.get(server.url + "/health").status_code == 200


async def _abort_one(llm, prompt):
    stream = await llm.add_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True), "to-abort")
    reps = llm.replicas
    where = reps.holder["to-abort"]
    async for _ in stream:
        if reps.stats[where].kv_blocks_used > 0:
            break
    stream.close()  # the client went away
    for _ in range(200):
        await asyncio.sleep(0.02)
        s = reps.stats[where]
        if s.kv_blocks_used == 0 and s.num_running == 0:
            return where, reps.loads[:]
    raise AssertionError(f"replica {where} still holds {reps.stats[where].kv_blocks_used} blocks")


def test_abort_frees_blocks_on_the_replica_that_held_the_request(server):
    llm = server.async_llm
    seen = set()
    for k in range(6):  # least-loaded routing with ties taken in turn: both replicas come up
        where, loads = on_server_loop(server, _abort_one(llm, {"prompt_token_ids": [11 + k] * 40}))
        seen.add(where)
        assert loads == [0, 0]
        if seen == {0, 1}:
            break
    assert seen == {0, 1}


async def _kill_replica_mid_stream(llm):
    reps = llm.replicas
    streams = [
        await llm.add_request(
            {"prompt_token_ids": [20 + i] * 20}, SamplingParams(max_tokens=300, ignore_eos=True), f"k{i}"
        )
        for i in range(4)
    ]
    held = {sid: reps.holder[sid] for sid in (f"k{i}" for i in range(4))}
    assert set(held.values()) == {0, 1}, held

    killed = []

    async def drain(st):
        n = 0
        try:
            async for out in st:
                n = len(out.outputs[0].token_ids)
                if n >= 5 and held[st.request_id] == 1 and not killed:
                    killed.append(n)
                    os.kill(reps.handles[1].process.pid, signal.SIGKILL)
            return ("done", n)
        except EngineDeadError:
            return ("dead", n)

    results = await asyncio.wait_for(asyncio.gather(*[drain(s) for s in streams]), 60)
    return held, results


def test_a_dead_replica_fails_its_requests_the_other_finishes_health_503(server):
    llm = server.async_llm
    held, results = on_server_loop(server, _kill_replica_mid_stream(llm), timeout=90)
    for (sid, where), (how, n) in zip(held.items(), results, strict=True):
        if where == 1:
            assert how == "dead" and n < 300, (sid, how, n)
        else:
            assert (how, n) == ("done", 300), (sid, how, n)
    assert not llm.is_alive
    assert httpx.get(server.url + "/health").status_code == 503
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code >= 500
    llm.replicas.handles[1].process.join(5)
    assert llm.replicas.handles[1].process.exitcode is not None  # reaped


def test_shutdown_stops_every_replica(server):
    reps = server.async_llm.replicas
    assert reps.handles[0].is_alive()
    server.stop()  # (the fixture's teardown stops it again: a no-op)
    assert not any(h.is_alive() for h in reps.handles)
    assert all(h.process.exitcode is not None for h in reps.handles)


# -- offline --------------------------------------------------------------------------------
@pytest.mark.slow  # two more engine processes start (~25 s on a loaded 2-core machine)
def test_offline_llm_with_two_replicas_matches_one_engine(model_dir, offline):
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 2 * i))} for i in range(8)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2)
    want = [[c.token_ids for c in o.outputs] for o in offline.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(model_dir, data_parallel_size=2, **ENGINE_KW)
    try:
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want
        reps = llm.engine.core.replicas
        assert all(s.prompt_tokens > 0 for s in reps.stats) and reps.holder == {}
        assert llm.get_stats().prompt_tokens == sum(s.prompt_tokens for s in reps.stats)
    finally:
        llm.shutdown()
    assert not any(h.is_alive() for h in reps.handles)


@pytest.mark.slow  # two engine processes start
def test_bench_dp_smoke(model_dir, tmp_path, capsys):
    from pagedserve.bench import dp

    out = tmp_path / "dp.json"
    dp.main(
        [
            "--model",
            model_dir,
            "--dtype",
            "float32",
            "--groups",
            "3",
            "--per-group",
            "3",
            "--system-len",
            "48",
        ]
        + ["--question-len", "5", "--output-len", "2", "--configs", "dp2-prefix", "--output-json", str(out)]
    )
    (r,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert r["config"] == "dp2-prefix" and r["requests"] == 9
    assert r["hit_rate"] == r["ideal_hit_rate"] == round(3 * 2 * 48 / (9 * 53), 4)
    assert (
        sum(r["routed"].values()) == 9
        and r["routed"].get("0/prefix", 0) + r["routed"].get("1/prefix", 0) == 6
    )
    assert json.loads(out.read_text())[0]["hit_rate"] == r["hit_rate"]


def test_router_by_length_serves_short_and_long_apart_and_falls_back():
    r = DPRouter(4, 16, "length", short_tokens=512)
    busy = [1, 1, 1, 1]
    assert [r.route([7] * 5, None, busy, work=100)[0] in (0, 1) for _ in range(6)] == [True] * 6
    assert [r.route([8] * 5, None, busy, work=3000)[0] in (2, 3) for _ in range(6)] == [True] * 6
    assert r.route([9] * 5, None, busy, work=100)[1] == "short"
    assert r.route([9] * 5, None, [5, 5, 0, 0], work=3000) == (2, "long")
    # the long set idles: a short request may use it
    assert r.route([10] * 5, None, [3, 3, 0, 0], work=100)[0] in (2, 3)
    # a long replica gone: long work falls back to the other long one, then to any replica
    r.unavailable = {2}
    assert all(r.route([11] * 5, None, busy, work=3000)[0] == 3 for _ in range(3))
    r.unavailable = {2, 3}
    assert r.route([12] * 5, None, busy, work=3000)[0] in (0, 1)
    # a prefix hit still wins across the sets
    r2 = DPRouter(2, 16, "length", short_tokens=512)
    doc = list(range(64))
    assert r2.route(doc, None, [1, 0], work=3000) == (1, "long")
    assert r2.route(doc + [1], None, [1, 1], work=100) == (1, "prefix")
