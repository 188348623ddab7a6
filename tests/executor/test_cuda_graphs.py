"""CUDA-graph bucketing and padding, checked on the CPU (the capture itself needs a GPU:
benchmarks/gpu_check.sh)."""

import torch

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.executor.cuda_graphs import DecodeBuffers, capture_sizes, padded_size
from pagedserve.executor.loader import load_hf_config_dict
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.sampling_params import SamplingParams


def test_capture_sizes_and_padding_choice():
    assert capture_sizes(256) == [
        1,
        2,
        4,
        8,
        16,
        24,
        32,
        40,
        48,
        56,
        64,
        80,
        96,
        112,
        128,
        144,
        160,
        176,
        192,
        208,
        224,
        240,
        256,
    ]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 64, 65)] == [1, 4, 8, 16, 24, 64, None]


def test_buffers_pad_with_null_slot_rows():
    b = DecodeBuffers.allocate(8, 6, "cpu")
    b.fill(
        torch.tensor([5, 6, 7]),
        torch.tensor([10, 3, 40]),
        torch.tensor([33, 50, 70]),
        torch.tensor([[2, 3], [4, 0], [5, 6]]),
        torch.tensor([11, 4, 41]),
        size=4,
    )
    assert b.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert b.slot_mapping[:4].tolist() == [33, 50, 70, 0]  # padding writes to the null block
    assert b.seq_lens[:4].tolist() == [11, 4, 41, 1]
    assert b.block_tables[3].tolist() == [0] * 6 and b.block_tables[0].tolist() == [2, 3, 0, 0, 0, 0]
    # a later, smaller batch fully overwrites the rows it uses
    b.fill(
        torch.tensor([9]),
        torch.tensor([1]),
        torch.tensor([17]),
        torch.tensor([[1]]),
        torch.tensor([2]),
        size=2,
    )
    assert b.block_tables[0].tolist() == [1, 0, 0, 0, 0, 0] and b.seq_lens[:2].tolist() == [2, 1]


def test_graph_metadata_is_views_of_the_buffers():
    """A replay reads the addresses captured: every tensor of a graph's metadata must be a view
    of the runner's buffers (a temporary query_start_loc, freed after capture, was read as
    garbage on an H200: Phi-3's per-token lengths, a device-side assert)."""
    b = DecodeBuffers.allocate(8, 6, "cpu")
    meta = b.metadata(4, 256)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        t, buf = getattr(meta, name), getattr(b, name)
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), name
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]


@torch.inference_mode()
def test_padded_decode_gives_the_real_rows_exactly(checkpoint):
    path = checkpoint("llama")
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(path))
    runner = ModelRunner(path, cfg, dtype="float32", device="cpu", attention_backend="torch")
    runner.initialize_kv_cache(64, 16)
    sched = Scheduler(SchedulerConfig(max_model_len=256), CacheConfig(block_size=16), 64)
    for i, n in enumerate((5, 20, 33)):
        sched.add_request(
            Request(f"r{i}", list(range(3 + i, 3 + i + n)), SamplingParams(max_tokens=8), max_tokens=8)
        )
    so = sched.schedule()
    runner.execute_model(so)  # prefill
    from pagedserve.messages import ModelRunnerOutput

    sched.update_from_output(so, ModelRunnerOutput({r: 7 for r in ("r0", "r1", "r2")}))
    so = sched.schedule()  # three decodes
    runner.input_batch.update(so)
    inp = runner.input_batch.prepare(so)
    m = inp.meta
    kv_before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    eager = runner.model(inp.input_ids, inp.positions, runner.kv_caches, m)
    kv_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.kv_caches[:] = kv_before  # rerun from the same cache state, padded to 8 rows
    b = DecodeBuffers.allocate(8, 16, "cpu")
    b.fill(inp.input_ids, inp.positions, m.slot_mapping, m.block_tables, m.seq_lens, size=8)
    padded = runner.model(b.input_ids[:8], b.positions[:8], runner.kv_caches, b.metadata(8, 256))
    assert torch.allclose(padded[:3], eager, atol=1e-5)
    # the padding rows wrote only into the null block 0: every real block is as after the eager run
    for (ke, ve), (kp, vp) in zip(kv_eager, runner.kv_caches):
        assert torch.allclose(ke[1:], kp[1:], atol=1e-5) and torch.allclose(ve[1:], vp[1:], atol=1e-5)
