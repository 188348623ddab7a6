"""The offline clients of the engine core, driven directly: the same tokens in-process and
over ZMQ (one replica), refusals and aborts end requests and free their blocks, and a
killed core process is an EngineDeadError, not a hang."""

import os
import signal
import time

import pytest

from pagedserve.core.engine_core import CoreInfo
from pagedserve.engine.core_client import EngineCoreClient, InprocClient, MPClient
from pagedserve.engine.core_handle import CoreHandle
from pagedserve.engine_args import EngineArgs
from pagedserve.errors import EngineDeadError
from pagedserve.messages import EngineCoreRequest
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def config(path):
    return EngineArgs(model=path, dtype="float32", num_kv_blocks=64, max_model_len=128).create_engine_config()


def request(rid: str, n: int, max_tokens: int = 6) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(3, 3 + n)), sampling_params=GREEDY, max_tokens=max_tokens)


def run(client: EngineCoreClient, reqs) -> dict[str, list[int]]:
    client.add_requests(reqs)
    tokens, done = {r.request_id: [] for r in reqs}, set()
    while len(done) < len(reqs):
        for o in client.get_output().outputs:
            tokens[o.req_id] += o.new_token_ids
            if o.finished:
                done.add(o.req_id)
    return tokens


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("llama")


def test_inproc_and_multiprocess_clients_agree(path):
    inproc = InprocClient(config(path))
    want = run(inproc, [request("a", 5), request("b", 17)])
    assert all(len(t) == 6 for t in want.values())
    inproc.shutdown()
    mp = MPClient(config(path))
    try:
        assert isinstance(mp.info, CoreInfo) and mp.engine_core is None
        assert isinstance(mp.handle, CoreHandle) and mp.handle.is_alive()
        assert run(mp, [request("a", 5), request("b", 17)]) == want
        assert mp.get_stats().kv_blocks_used == 0
    finally:
        mp.shutdown()
    assert not mp.handle.is_alive()


def test_a_refused_request_ends_as_an_abort_and_an_aborted_one_frees_its_blocks(path):
    mp = MPClient(config(path))
    try:
        mp.add_requests([request("long", 10, max_tokens=100)])
        mp.add_requests([request("too_long", 200)])  # the core refuses it (past max_model_len)
        seen = {}
        while "too_long" not in seen:
            for o in mp.get_output().outputs:
                seen[o.req_id] = o.finish_reason
        assert seen["too_long"] == "abort"
        mp.abort_requests(["long"])
        deadline = time.monotonic() + 10
        while mp.get_stats().kv_blocks_used and time.monotonic() < deadline:
            mp.get_output() if mp.get_stats().num_running else time.sleep(0.05)
        assert mp.get_stats().kv_blocks_used == 0
    finally:
        mp.shutdown()


def test_a_killed_core_process_is_an_engine_dead_error(path):
    mp = MPClient(config(path))
    try:
        mp.add_requests([request("a", 5, max_tokens=100)])
        os.kill(mp.handle.process.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="exited"):
            while True:
                mp.get_output()
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            mp.add_requests([request("b", 5)])
    finally:
        mp.shutdown()
