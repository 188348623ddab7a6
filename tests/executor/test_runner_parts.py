"""The ModelRunner's parts on their own: dtype resolution, the persistent input batch,
prompt logprobs and speculative verification helpers."""

import numpy as np
import pytest
import torch

from pagedserve.executor import dtypes
from pagedserve.executor.input_batch import InputBatch
from pagedserve.executor.logprobs import collect_prompt_logprobs
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.spec_verify import target_probs
from pagedserve.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams


def cfg(checkpoint_dtype):
    return ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 1,
            "intermediate_size": 128,
            "vocab_size": 100,
            "torch_dtype": checkpoint_dtype,
        }
    )


def test_dtype_auto_follows_the_checkpoint_and_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    assert dtypes.resolve_dtype("auto", cfg("float32"), cpu) == torch.float32
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: True)
    assert dtypes.resolve_dtype("auto", cfg("bfloat16"), cpu) == torch.bfloat16
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: False)
    assert dtypes.resolve_dtype("auto", cfg("bfloat16"), cpu) == torch.float32
    assert dtypes.resolve_dtype("float16", cfg("float32"), cpu) == torch.bfloat16  # no fast fp16 on CPUs


def test_kv_dtype():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert dtypes.resolve_kv_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert dtypes.resolve_kv_dtype("fp8", torch.float32, cpu) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="CPU only"):
        dtypes.resolve_kv_dtype("float16", torch.bfloat16, gpu)


def new(rid, toks, start, blocks, output=()):
    return NewRequestData(
        req_id=rid,
        token_ids=toks,
        num_computed_tokens=start,
        block_ids=blocks,
        sample=True,
        sampling_params=SamplingParams(seed=3),
        prompt_token_ids=list(range(start + len(toks))),
        output_token_ids=list(output),
    )


def test_input_batch_keeps_state_and_flattens_decodes_first():
    b = InputBatch(torch.device("cpu"), block_size=4)
    b.update(SchedulerOutput([new("p", [7, 8, 9, 10, 11], 0, [3, 5]), new("d", [9], 6, [1, 2])], 6))
    assert set(b.requests) == {"p", "d"} and b.requests["p"].generator is not None
    inp = b.prepare(SchedulerOutput([new("p", [7, 8, 9, 10, 11], 0, [3, 5]), new("d", [9], 6, [1, 2])], 6))
    assert [sr.req_id for sr in inp.order] == ["d", "p"]  # decodes first
    assert inp.cu.tolist() == [0, 1, 6]
    assert inp.positions.tolist() == [6, 0, 1, 2, 3, 4]
    # slot = block * block_size + offset: d's position 6 is in its 2nd block (2), offset 2
    assert inp.meta.slot_mapping.tolist() == [2 * 4 + 2, 12, 13, 14, 15, 20]
    assert inp.meta.seq_lens.tolist() == [7, 5] and inp.meta.num_decodes == 1
    # a cached request's new blocks extend its table; finished / preempted ones are forgotten
    step = CachedRequestData(req_id="p", token_ids=[12], num_computed_tokens=5, block_ids=[6], sample=True)
    b.update(SchedulerOutput([step], 1, finished_req_ids={"d"}))
    assert b.requests["p"].block_ids == [3, 5, 6] and "d" not in b.requests and "d" not in b.generators
    b.update(SchedulerOutput([], 0, preempted_req_ids={"p"}))
    assert b.requests == {} and "p" in b.generators  # a seed survives preemption


class FakeModel:
    def __init__(self, logits):
        self.logits = logits

    def compute_logits(self, h):
        return self.logits[: h.shape[0]]


def test_prompt_logprobs_rank_and_top_k():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]))
    st = type("S", (), {})()
    st.params = SamplingParams(prompt_logprobs=1)
    st.prompt_token_ids = [0, 1, 2]
    sr = CachedRequestData(req_id="r", token_ids=[0, 1, 2], num_computed_tokens=0, block_ids=[], sample=True)
    out = ModelRunnerOutput({})
    collect_prompt_logprobs(FakeModel(logits), [sr], [st], np.array([0, 3]), torch.zeros(3, 8), out)
    first, second = out.prompt_logprobs["r"]
    assert first[1].rank == 2 and abs(first[1].logprob - np.log(0.3)) < 1e-6 and first[0].rank == 1
    assert second[2].rank == 1 and len(second) == 1  # the target is the top-1 itself


def test_target_probs_is_the_sampling_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p.sum(-1), torch.ones(1)) and p[0, 2:].sum() == 0
    assert torch.allclose(p[0, :2], torch.softmax(torch.tensor([2.0, 1.0]), -1))


def test_uniproc_executor_sizes_and_runs_the_model(checkpoint):
    from pagedserve.engine_args import EngineArgs
    from pagedserve.executor.executor import Executor, UniProcExecutor
    from pagedserve.executor.loader import load_hf_config_dict

    path = checkpoint("llama")
    config = EngineArgs(model=path, dtype="float32", block_size=8).create_engine_config()
    mc = ModelConfig.from_hf_dict(load_hf_config_dict(path))
    ex = UniProcExecutor(config, path, mc, "cpu")
    assert isinstance(ex, Executor) and ex.dtype_name == "float32" and ex.device == "cpu"
    per_block = 2 * mc.num_hidden_layers * 8 * mc.num_key_value_heads * mc.head_dim * 4
    assert ex.kv_bytes_per_block(8) == per_block
    assert ex.determine_available_kv_memory(0.9, 2048) == 2 << 30  # the CPU default
    ex.initialize_kv_cache(16, 8)
    assert ex.runner.block_size == 8
    out = ex.execute_model(SchedulerOutput([new("r", [3, 4, 5], 0, [1])], 3))
    assert set(out.sampled_token_ids) == {"r"}


def test_parallel_state_defaults_and_worker_spec_pickles():
    import pickle

    from pagedserve.executor.distributed.parallel_state import default_backend, get_tp_rank, get_tp_world_size
    from pagedserve.executor.distributed.worker import WorkerSpec

    assert default_backend("cpu") == "gloo" and default_backend("cuda") == "nccl"
    assert get_tp_rank() == 0 and get_tp_world_size() == 1  # no group: one rank
    spec = WorkerSpec("m", cfg("float32"), world_size=2, num_local=2, backend="gloo", device="cpu", runner_kwargs={"seed": 1})
    assert pickle.loads(pickle.dumps(spec)) == spec
