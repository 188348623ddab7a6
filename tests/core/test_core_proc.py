"""The engine core's busy loop (core/core_proc.py) over its ZMQ pipes, in a thread:
commands in, one EngineCoreOutputs per step out, refusals reported, SHUTDOWN ends it."""

import pickle

import pytest
import zmq

from pagedserve.core.core_proc import EngineCoreProc
from pagedserve.engine.core_handle import CoreHandle
from pagedserve.engine_args import EngineArgs
from pagedserve.messages import CoreRequestType, EngineCoreOutputs, EngineCoreRequest
from pagedserve.sampling_params import SamplingParams


@pytest.fixture
def core(checkpoint):
    cfg = EngineArgs(model=checkpoint("llama"), dtype="float32", num_kv_blocks=64, max_model_len=128).create_engine_config()
    ctx = zmq.Context()
    handle = CoreHandle(cfg, process=False)
    commands, outputs = handle.bind(ctx, ctx)
    handle.start()
    yield handle, commands, outputs
    commands.send(pickle.dumps((CoreRequestType.SHUTDOWN, None)))
    handle.join(10)
    commands.close(0)
    outputs.close(0)
    ctx.term()


def recv(outputs) -> EngineCoreOutputs:
    assert outputs.poll(20_000), "no message from the core loop"
    return pickle.loads(outputs.recv())


def test_the_loop_runs_requests_and_reports_refusals(core):
    handle, commands, outputs = core
    assert isinstance(handle.thread.name, str) and handle.is_alive() and handle.sentinel is None
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ok = EngineCoreRequest(request_id="ok", prompt_token_ids=[5, 6, 7], sampling_params=params, max_tokens=3)
    bad = EngineCoreRequest(request_id="bad", prompt_token_ids=[5] * 200, sampling_params=params, max_tokens=3)
    commands.send(pickle.dumps((CoreRequestType.ADD, [ok])))
    commands.send(pickle.dumps((CoreRequestType.ADD, [bad])))
    tokens, errors, steps = [], {}, 0
    while len(tokens) < 3 or "bad" not in errors:
        msg = recv(outputs)
        assert msg.fatal is None and msg.stats is not None
        errors |= msg.errors
        tokens += [t for o in msg.outputs if o.req_id == "ok" for t in o.new_token_ids]
        steps += bool(msg.outputs)
    assert len(tokens) == 3 and "maximum context length" in errors["bad"]
    assert msg.step_seconds > 0 and steps >= 3


def test_the_step_delay_test_hook_is_read_from_envs(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TEST_SLOW_ENGINE", "1:0.25")

    class Core:
        config = EngineArgs().create_engine_config()

    p = EngineCoreProc(Core(), "inproc://a", "inproc://b", None, engine_index=1)
    q = EngineCoreProc(Core(), "inproc://c", "inproc://d", None, engine_index=0)
    assert p.step_delay == 0.25 and q.step_delay == 0.0
    for loop in (p, q):
        loop.input.close(0)
        loop.output.close(0)
        loop.ctx.term()


def test_each_data_parallel_replica_writes_its_own_step_log(checkpoint, tmp_path):
    import torch

    from pagedserve.core.core_proc import _place_replica

    path = str(tmp_path / "steps.jsonl")
    threads = torch.get_num_threads()
    try:
        for i in (0, 1):
            cfg = EngineArgs(
                model=checkpoint("llama"), dtype="float32", num_kv_blocks=64, max_model_len=128,
                data_parallel_size=2, step_log=path,
            ).create_engine_config()
            _place_replica(cfg, i)  # in the replica's process, before its EngineCore
            assert cfg.observability.step_log == f"{path}.dp{i}"
    finally:
        torch.set_num_threads(threads)
