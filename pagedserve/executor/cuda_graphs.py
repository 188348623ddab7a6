"""CUDA graphs for decode-only steps.

A decode step of n sequences is padded to the smallest captured batch size >= n and
replayed from static buffers. Padding rows use token 0 at position 0, write their K/V to
slot 0 (the null block, never handed to a request) and attend to that one slot, so they
cannot disturb real sequences; their outputs are dropped. The attention kernels' grids
depend only on the batch size and max_model_len, so one graph per size serves every
context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.executor.attention.backend import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond, up to max_num_seqs (included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    s = 16
    while s <= max_num_seqs:
        sizes.append(s)
        s += 8 if s < 64 else 16
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n sequences, or None (run eagerly)."""
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass
class DecodeBuffers:
    """Static inputs of the captured graphs (views of the first `size` rows are used).
    Invariant: every tensor a graph reads lives as long as the graph (a replay reads the
    addresses captured: a temporary freed after capture is read as whatever took its place;
    a freed query_start_loc once made Phi-3's per-token lengths garbage on an H200)."""

    input_ids: torch.Tensor  # [max_size]
    positions: torch.Tensor  # [max_size]
    slot_mapping: torch.Tensor  # [max_size]
    block_tables: torch.Tensor  # [max_size, max_blocks_per_seq]
    seq_lens: torch.Tensor  # [max_size]
    query_start_loc: torch.Tensor  # [max_size + 1]: 0, 1, 2, ... (one token per request), constant

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device) -> DecodeBuffers:
        z = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            z(max_size),
            z(max_size),
            z(max_size),
            z(max_size, max_blocks),
            torch.ones(max_size, dtype=torch.int64, device=device),
            torch.arange(max_size + 1, dtype=torch.int64, device=device),
        )

    def fill(self, input_ids, positions, slot_mapping, block_tables, seq_lens, size: int) -> None:
        """Copy a real batch of n <= size decodes in; rows n..size-1 become padding."""
        n, w = block_tables.shape
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.block_tables[:n, :w].copy_(block_tables)
        self.block_tables[:n, w:].zero_()
        self.seq_lens[:n].copy_(seq_lens)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].zero_()  # the null block's first slot
            self.block_tables[n:size].zero_()
            self.seq_lens[n:size].fill_(1)

    def metadata(self, size: int, max_model_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=size,
            num_decodes=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=max_model_len,
            max_decode_seq_len=max_model_len,
            query_start_loc_list=list(range(size + 1)),
            seq_lens_list=[max_model_len] * size,
        )


class CudaGraphRunner:
    """Captures model(decode batch) for each size; replays the right one."""

    def __init__(
        self, model, kv_caches, sizes: list[int], max_blocks: int, max_model_len: int, device
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.bufs = DecodeBuffers.allocate(self.sizes[-1], max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}  # kept: a backend caches tensors in them

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        b = self.bufs
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            meta = self.metas[size] = b.metadata(size, self.max_model_len)
            args = (b.input_ids[:size], b.positions[:size], self.kv_caches, meta)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (Triton compiles, allocator settles)
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[size] = self.model(*args)
            self.graphs[size] = g
        torch.cuda.synchronize()

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens) -> torch.Tensor | None:
        """Hidden states [n, E] for a decode-only batch, or None if no graph fits it."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        if size is None or block_tables.shape[1] > self.bufs.block_tables.shape[1]:
            return None
        self.bufs.fill(input_ids, positions, slot_mapping, block_tables, seq_lens, size)
        self.graphs[size].replay()
        return self.outputs[size][:n]
