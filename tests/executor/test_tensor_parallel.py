"""Tensor parallelism on CPU (gloo, 2 worker processes): greedy tokens identical to one
process and to transformers, logprobs within 1e-4, tokens equal on every rank, KV cache per
rank; a worker killed mid-generation ends the engine with an error naming its rank, within
seconds, with no process left behind; ranks joining from "another machine" over loopback.

Each 2-rank engine costs a few seconds of start-up (two spawned interpreters importing
torch), so the fast tests share as few engines as they can.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.executor.distributed.multiproc_executor import MultiprocExecutor, WorkerDiedError
from pagedserve.executor.distributed.sharding import TPLayout, shard_vocab
from pagedserve.executor.distributed.shm_ring import ShmRing
from pagedserve.executor.loader import load_hf_config_dict
from pagedserve.executor.model_config import ModelConfig
from tests.checkpoints import load_hf

LOGPROB_TOL = 1e-4
PROMPTS = [[(7 * i + j) % 1000 for j in range(5 + 9 * i)] for i in range(4)]
PLP_PROMPT = [(13 * j + 5) % 1000 for j in range(21)]


def _llm(path, tp, **kw):
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=120, max_num_seqs=8, skip_tokenizer_init=True) | kw
    return LLM(path, tensor_parallel_size=tp, **kw)


def _run(llm, max_tokens=8):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    plp = llm.generate(  # a prompt never seen (no prefix-cache hit)
        {"prompt_token_ids": PLP_PROMPT},
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
        use_tqdm=False,
    )[0].prompt_logprobs
    return [o.outputs[0] for o in outs], plp


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for tid in a:
        assert abs(a[tid].logprob - b[tid].logprob) <= LOGPROB_TOL, (tid, a[tid], b[tid])
        assert a[tid].rank == b[tid].rank


def _children() -> set[int]:
    """Live descendants of this process, except multiprocessing's resource tracker (one per
    session, started with the first shared-memory ring; it outlives engines by design)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize(
    "arch",
    [
        "llama_tp",  # 4 q heads, 1 KV head (replicated), vocabulary 1001 (padded)
        # experts split within (each rank 24 of 48 rows), shared expert, a dense layer, sliding
        # layers (KV cache groups on every rank)
        "qwen2_moe_tp",
        pytest.param("qwen2_tp", marks=pytest.mark.slow),  # 2 KV heads (split), q/k/v bias, tied LM head
        pytest.param("qwen3_tp", marks=pytest.mark.slow),  # 2 KV heads, q/k norms, head_dim 40
    ],
)
def test_tp2_matches_tp1_and_transformers(checkpoint, arch, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TP_CHECK_TOKENS", "1")  # ranks compare their tokens each step
    path = checkpoint(arch)
    one = _llm(path, 1)
    ref_out, ref_plp = _run(one)
    kv_one = one.engine.core.engine_core.executor.kv_bytes_per_block(16)
    one.shutdown()
    before = _children()
    two = _llm(path, 2)
    ex = two.engine.core.engine_core.executor
    assert isinstance(ex, MultiprocExecutor) and len(ex.pids) == 2
    try:
        out, plp = _run(two)
        # random sampling too: every rank draws the same tokens (the check raises otherwise)
        sampled = two.generate(
            [{"prompt_token_ids": p} for p in PROMPTS[:2]],
            [SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, n=2), SamplingParams(max_tokens=6, seed=7)],
            use_tqdm=False,
        )
        assert all(len(c.token_ids) == 6 for o in sampled for c in o.outputs)
        kv_two = ex.kv_bytes_per_block(16)
        comm = ex.comm_stats()
    finally:
        two.shutdown()
    # KV cache per rank: its own KV heads (a single KV head is replicated on both ranks)
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(path))
    assert kv_two == kv_one * max(1, cfg.num_key_value_heads // 2) // cfg.num_key_value_heads
    # every layer all-reduced (o_proj + down_proj) and the logits gathered on each rank
    assert all(c["calls"] > 2 * cfg.num_hidden_layers for c in comm)
    hf = load_hf(path)
    for p, o, r in zip(PROMPTS, out, ref_out):
        assert o.token_ids == r.token_ids
        with torch.inference_mode():
            ids = torch.tensor([p])  # an explicit mask: token 0 (the pad id) starts a prompt
            want = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, eos_token_id=None
            )[0, len(p) :].tolist()
        assert o.token_ids == want
        for a, b in zip(o.logprobs, r.logprobs):
            _close(a, b)
    assert len(plp) == len(ref_plp) == len(PLP_PROMPT)
    for a, b in zip(plp[1:], ref_plp[1:]):
        _close(a, b)
    assert _children() <= before  # the ranks are gone


def test_worker_killed_mid_generation_names_the_rank(checkpoint):
    before = _children()
    llm = _llm(checkpoint("llama_tp"), 2, max_model_len=2048, num_kv_blocks=300)
    ex = llm.engine.core.engine_core.executor
    pids = list(ex.pids)
    assert set(pids) <= _children()
    result: dict = {}

    def gen():
        try:
            llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS],
                SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True),
                use_tqdm=False,
            )
            result["done"] = True
        except Exception as e:  # noqa: BLE001
            result["error"], result["at"] = e, time.monotonic()

    t = threading.Thread(target=gen)
    t.start()
    time.sleep(1.5)  # mid-generation: 4 x 1500 tokens take far longer
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    t.join(30)
    assert not t.is_alive()
    err = result.get("error")
    assert isinstance(err, WorkerDiedError), result
    assert "rank 1" in str(err) and str(pids[1]) in str(err) and "signal 9" in str(err)
    assert result["at"] - killed < 5.0
    # the engine stays stopped with that error, and no worker is left behind
    with pytest.raises(WorkerDiedError, match="rank 1"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    llm.shutdown()
    assert _children() <= before


@pytest.mark.slow
def test_engine_core_process_with_tp2_and_clean_shutdown(checkpoint):
    """The engine core in its own (daemon) process starts its ranks too; n-gram speculation
    verifies its guesses on the sharded model (same greedy tokens); shutdown ends all."""
    path = checkpoint("llama_tp")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": PROMPTS[1]}]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one = _llm(path, 1)
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    one.shutdown()
    before = _children()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = _llm(path, 2, engine_core_process=True, speculative_config=spec)
    assert len(_children() - before) >= 3  # the core and its two ranks
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == ref
    assert llm.get_stats().spec_num_draft_tokens > 0
    llm.shutdown()
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children() - before


@pytest.mark.slow
def test_worker_that_fails_to_load_reports_it(checkpoint, tmp_path):
    src = checkpoint("llama_tp")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            os.symlink(os.path.join(src, f), bad / f)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    before = _children()
    with pytest.raises(RuntimeError, match=r"rank \d failed during start-up"):
        _llm(str(bad), 2)
    assert _children() <= before


@pytest.mark.slow
def test_remote_ranks_over_loopback(checkpoint, monkeypatch):
    """TP=4 as on two machines: ranks 0-1 started by the engine, ranks 2-3 by hand (torchrun's
    variables, no model flags) and reached through torch.distributed: TP=1's tokens. Four
    ranks on the single-KV-head checkpoint: one q head each, the KV head replicated 4 times,
    the vocabulary of 1001 padded to 4 x 251."""
    path = checkpoint("llama_tp")
    ref, _ = _run(one := _llm(path, 1), max_tokens=6)
    one.shutdown()
    port = str(29500 + os.getpid() % 1000)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    remotes = [
        subprocess.Popen(
            [sys.executable, "-m", "pagedserve.executor.distributed.worker"],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r - 2)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (2, 3)
    ]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.setenv("PAGEDSERVE_LOCAL_TP_RANKS", "2")
    monkeypatch.setenv("PAGEDSERVE_TP_CHECK_TOKENS", "1")
    try:
        llm = _llm(path, 4)
        assert len(llm.engine.core.engine_core.executor.pids) == 2
        out, _ = _run(llm, max_tokens=6)
        llm.shutdown()
        for p in remotes:
            assert p.wait(30) == 0, p.stdout.read()
    finally:
        for p in remotes:
            if p.poll() is None:
                p.kill()
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    for o, r in zip(out, ref):
        for a, b in zip(o.logprobs, r.logprobs):
            _close(a, b)


def test_shm_ring_messages_of_any_size_reach_every_reader():
    w = ShmRing(2, chunk_bytes=64, num_chunks=3)
    readers = [ShmRing(*w.handle()[:3], name=w.name, reader=r) for r in range(2)]
    msgs = [("small", 1), {"big": list(range(500))}, b"x" * 1000, None]
    got = {0: [], 1: []}

    def read(r):
        for _ in msgs:
            got[r].append(readers[r].dequeue(timeout=10))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for m in msgs:  # bigger than the whole ring: the writer waits for the readers
        w.enqueue(m, timeout=10)
    for t in threads:
        t.join(10)
    assert got == {0: msgs, 1: msgs}
    with pytest.raises(TimeoutError):  # a reader that never reads holds the writer back
        for i in range(4):
            w.enqueue(i, timeout=0.2)
    for r in readers:
        r.close()
    w.close(unlink=True)


def test_layout_and_vocab_padding():
    cfg = ModelConfig("LlamaForCausalLM", 1001, 128, 160, 2, 4, 1, 32)
    lays = [TPLayout.make(cfg, r, 2) for r in range(2)]
    assert [(x.num_heads, x.num_kv_heads, x.kv_head_start, x.vocab_per_rank) for x in lays] == [
        (2, 1, 0, 501),
        (2, 1, 0, 501),
    ]
    w = torch.arange(1001.0)[:, None]
    parts = [shard_vocab(w, x) for x in lays]
    assert parts[1].shape[0] == 501 and parts[1][-1].item() == 0.0  # padding row
    assert torch.equal(torch.cat(parts)[:1001], w)
    four = ModelConfig("LlamaForCausalLM", 1001, 128, 160, 2, 8, 2, 16)
    assert [TPLayout.make(four, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_attention_heads=3"):
        TPLayout.make(ModelConfig("LlamaForCausalLM", 1001, 96, 160, 2, 3, 1, 32), 0, 2)


@pytest.mark.slow
def test_packed_gguf_shards(tmp_path, monkeypatch):
    """A GGUF runs packed on every rank (rows of packed blocks split by rank, K at block
    boundaries, the vocabulary padded with zero blocks): same tokens as one process."""
    gguf = pytest.importorskip("gguf")
    from pagedserve.executor import cpp_build
    from tests.checkpoints import build_checkpoint
    from tests.executor.test_gguf import write_gguf

    kernels = cpp_build.cache_root()  # the converted GGUF goes to a cache of its own; the C++
    os.makedirs(kernels, exist_ok=True)  # kernels are those already built (not 2 min of builds)
    os.makedirs(tmp_path / "cache")
    os.symlink(kernels, tmp_path / "cache" / "kernels")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = build_checkpoint(str(tmp_path / "hf"), "llama_tp", intermediate_size=256)  # K shards of 128
    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), gguf.GGMLQuantizationType.Q8_0)
    one = _llm(path, 1)
    ref, _ = _run(one, max_tokens=6)
    one.shutdown()
    two = _llm(path, 2)
    assert all(i["packed_layers"] > 0 for i in two.engine.core.engine_core.executor.worker_info)
    out, _ = _run(two, max_tokens=6)
    two.shutdown()
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        for a, b in zip(o.logprobs, r.logprobs):
            _close(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (benchmarks/gpu_check.sh runs it)")
@pytest.mark.parametrize("arch", ["llama_tp", "qwen2_tp"])
def test_tp2_on_two_gpus_matches_one_gpu(checkpoint, arch, monkeypatch):
    """NCCL, one GPU per rank, float32: tokens of one GPU, logprobs within 1e-4."""
    monkeypatch.setenv("PAGEDSERVE_TP_CHECK_TOKENS", "1")
    path = checkpoint(arch)
    one = _llm(path, 1, device="cuda")
    ref, _ = _run(one)
    one.shutdown()
    two = _llm(path, 2, device="cuda")
    assert [i["device"] for i in two.engine.core.engine_core.executor.worker_info] == ["cuda:0", "cuda:1"]
    out, _ = _run(two)
    two.shutdown()
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        for a, b in zip(o.logprobs, r.logprobs):
            _close(a, b)
