"""`pagedserve bench lora`'s random adapters are valid PEFT LoRA directories for the base
(the engine's own check accepts them, with the ranks and targets asked for)."""

from pagedserve.bench.lora import ALL_TARGETS, write_random_adapter
from pagedserve.lora import BaseDims, load_peft_adapter


def test_random_adapters_load_with_their_rank_and_targets(tmp_path):
    dims = BaseDims(hidden=32, q_out=32, kv_out=16, intermediate=48, num_layers=2)
    d = write_random_adapter(str(tmp_path / "a"), dims, 4, ALL_TARGETS, seed=0)
    adapter = load_peft_adapter("a", d, dims, max_rank=16)
    assert adapter.rank == 4 and len(adapter.modules) == 2 * len(ALL_TARGETS)
    a, b, scale, r = adapter.modules[(1, "gate_proj")]
    assert a.shape == (4, 32) and b.shape == (48, 4) and scale == 32.0 / 4 and b.abs().sum() > 0
