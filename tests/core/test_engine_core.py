"""The engine core behind its seams: in a child process (ZMQ), its death, and
skip_tokenizer_init."""

import asyncio
import os
import signal
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.engine_args import EngineArgs
from pagedserve.errors import EngineDeadError, InvalidRequestError

ENGINE_KW = dict(dtype="float32", num_kv_blocks=200, max_model_len=256)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, **ENGINE_KW)
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(6)]
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_offline_engine_core_process_gives_the_same_tokens(model_dir, reference):
    prompts, want = reference
    llm = LLM(model_dir, engine_core_process=True, **ENGINE_KW)
    try:
        assert llm.engine.engine_core is None  # it lives in another process
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        # stop strings are found in the front end and end the request in the core
        text = llm.generate(
            "hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
        )
        assert text[0].outputs[0].text is not None
        stats = llm.get_stats()
        assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_used == 0
    finally:
        llm.shutdown()
    assert not llm.engine.core.handle.is_alive()


def test_skip_tokenizer_init_takes_token_ids_and_returns_no_text(model_dir, reference):
    prompts, want = reference
    llm = LLM(model_dir, skip_tokenizer_init=True, **ENGINE_KW)
    assert llm.get_tokenizer() is None
    outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:2]
    assert all(o.outputs[0].text == "" for o in outs)
    with pytest.raises(InvalidRequestError, match="tokenizer") as e:
        llm.generate("text needs a tokenizer", GREEDY, use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="stop strings"):
        llm.generate(prompts[0], SamplingParams(max_tokens=3, stop=["x"]), use_tqdm=False)


def test_input_processor_errors_name_their_param(model_dir):
    llm = LLM(model_dir, **ENGINE_KW)
    cases = [
        ({"prompt_token_ids": [1.0, 2.0]}, SamplingParams(max_tokens=2), "prompt"),
        ({"prompt_token_ids": [True, 2]}, SamplingParams(max_tokens=2), "prompt"),
        ({"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=2), "prompt"),
        ({"prompt_token_ids": [1] * 300}, SamplingParams(max_tokens=None), "prompt"),  # no room left
        ({"prompt_token_ids": [1] * 200}, SamplingParams(max_tokens=100), "max_tokens"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, logprobs=21), "logprobs"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, top_k=5000), "top_k"),
    ]
    for prompt, sp, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(prompt, sp, use_tqdm=False)
        assert e.value.param == param, (prompt, sp, e.value)
    # an omitted max_tokens means "up to max_model_len"
    out = llm.generate(
        {"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 6
    assert llm.get_stats().kv_blocks_used == 0


async def _stream_until_killed(llm: AsyncLLM, pid: int):
    stream = await llm.add_request(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=200, ignore_eos=True), "victim"
    )
    got, t_kill = 0, None
    with pytest.raises(EngineDeadError):
        async for out in stream:
            got = len(out.outputs[0].token_ids)
            if got >= 3 and t_kill is None:
                os.kill(pid, signal.SIGKILL)
                t_kill = time.monotonic()
    return got, time.monotonic() - t_kill


def test_core_process_killed_mid_stream_fails_requests_fast(model_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **ENGINE_KW))
    try:
        pid = llm.handle.process.pid
        got, waited = asyncio.run(_stream_until_killed(llm, pid))
        assert got >= 3 and waited < 5.0
        assert not llm.is_alive
        with pytest.raises(EngineDeadError):
            asyncio.run(llm.add_request("x", SamplingParams(max_tokens=2), "after"))
        llm.handle.process.join(5)
        assert llm.handle.process.exitcode is not None  # reaped: no zombie
    finally:
        llm.shutdown()


async def _abort_frees_blocks(llm: AsyncLLM):
    stream = await llm.add_request(
        {"prompt_token_ids": list(range(5, 60))}, SamplingParams(max_tokens=150, ignore_eos=True), "a"
    )
    async for _out in stream:
        if llm.stats.kv_blocks_used > 0:
            break
    stream.close()  # the client went away
    for _ in range(100):
        await asyncio.sleep(0.05)
        if llm.stats.kv_blocks_used == 0 and llm.stats.num_running == 0:
            return True
    return False


def test_abort_across_processes_frees_blocks(model_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **ENGINE_KW))
    try:
        assert asyncio.run(_abort_frees_blocks(llm))
        step_s, input_s, idle_s = llm.core_times
        assert step_s > 0 and input_s >= 0 and idle_s >= 0
    finally:
        llm.shutdown()
    assert not llm.handle.is_alive()


async def _shared_queue(llm: AsyncLLM, prompts):
    """Three requests whose outputs go to one queue (a server request's prompts); the third is
    closed at once, which aborts it: the two others end whole, the queue holds nothing of it
    past its close, and its blocks are freed."""
    queue: asyncio.Queue = asyncio.Queue()
    streams = [await llm.add_request(p, GREEDY, f"q{i}", queue=queue) for i, p in enumerate(prompts[:3])]
    streams[2].close()
    outs: dict[str, list] = {}
    while sum(1 for v in outs.values() if v[-1].finished) < 2:
        out = await asyncio.wait_for(queue.get(), 30)
        outs.setdefault(out.request_id, []).append(out)
    for _ in range(100):
        if llm.stats.kv_blocks_used == 0 and llm.stats.num_running == 0:
            break
        await asyncio.sleep(0.05)
    return outs, llm.stats.kv_blocks_used


def test_requests_share_one_output_queue(model_dir, reference):
    prompts, want = reference
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **ENGINE_KW))
    try:
        outs, used = asyncio.run(_shared_queue(llm, prompts))
        assert set(outs) <= {"q0", "q1", "q2"} and not any(o.finished for o in outs.get("q2", []))
        for i in (0, 1):
            assert outs[f"q{i}"][-1].outputs[0].token_ids == want[i]  # (cumulative outputs by default)
        assert used == 0
    finally:
        llm.shutdown()


# -- issue 17: a fault in one request's processing fails that request only ------------------------
def _poison_detokenizer(monkeypatch):
    """Requests with the stop string "<boom>" raise in the detokenizer; others are untouched."""
    from pagedserve.engine.detokenizer import IncrementalDetokenizer

    real = IncrementalDetokenizer.add_tokens_until_stop

    def poisoned(self, new_ids):
        if "<boom>" in self.stop:
            raise RuntimeError("detokenizer bug")
        return real(self, new_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens_until_stop", poisoned)


@pytest.mark.parametrize("process", [False, True], ids=["inproc", "core_process"])
def test_offline_output_fault_fails_one_request(model_dir, reference, monkeypatch, process):
    prompts, want = reference
    llm = LLM(model_dir, engine_core_process=process, **ENGINE_KW)
    try:
        _poison_detokenizer(monkeypatch)
        bad = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True, stop=["<boom>"])
        good = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["never-seen"])
        outs = llm.generate(prompts[:2], [bad, good], use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error" and "detokenizer bug" in outs[0].extra["error"]
        assert outs[1].outputs[0].finish_reason == "length" and outs[1].outputs[0].token_ids == want[1]
        after = llm.generate(prompts[2], GREEDY, use_tqdm=False)
        assert after[0].outputs[0].token_ids == want[2]
        stats = llm.get_stats()  # a core process's stats come with the last step, after the abort
        assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_used == 0
    finally:
        llm.shutdown()


async def _admission_fault(llm: AsyncLLM):
    bad = await llm.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, "poisoned")
    good = await llm.add_request({"prompt_token_ids": [8, 9, 10]}, GREEDY, "good")
    from pagedserve.errors import RequestFailedError

    with pytest.raises(RequestFailedError, match="grammar backend bug"):
        async for _ in bad:
            pass
    outs = [o async for o in good]
    later = [o async for o in await llm.add_request({"prompt_token_ids": [11, 12]}, GREEDY, "later")]
    for _ in range(100):
        if llm.stats.kv_blocks_used == 0 and llm.stats.num_running == 0:
            break
        await asyncio.sleep(0.05)
    return outs[-1], later[-1]


def test_core_admission_fault_fails_one_request(model_dir, monkeypatch):
    """An internal error while the core admits one request (e.g. a grammar backend that
    raises) refuses that request with a RequestFailedError; the core goes on."""
    from pagedserve.core.engine_core import EngineCore

    real = EngineCore.add_request

    def add_request(self, req):
        if req.request_id == "poisoned":
            raise RuntimeError("grammar backend bug")
        return real(self, req)

    monkeypatch.setattr(EngineCore, "add_request", add_request)
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, engine_core_process=False, **ENGINE_KW))
    try:
        good, later = asyncio.run(_admission_fault(llm))
        assert good.finished and len(good.outputs[0].token_ids) == GREEDY.max_tokens
        assert later.finished and len(later.outputs[0].token_ids) == GREEDY.max_tokens
        assert llm.is_alive and llm.stats.kv_blocks_used == 0 and llm.stats.num_running == 0
    finally:
        llm.shutdown()
