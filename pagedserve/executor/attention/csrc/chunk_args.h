#pragma once
// The per-request arguments of the paged prefill kernels (prefill_paged.h, and prefill_bf16.h's
// run, which prefill_amx.h shares), checked once: request r's queries are rows starts[r] ..
// starts[r] + qlens[r] - 1 of q, at positions seq_lens[r] - qlens[r] .. seq_lens[r] - 1, its
// keys read through row r of block_tables (int64 [R, max_blocks]). Every block a request reads
// lies inside the cache.
#include <torch/extension.h>

struct ChunkArgs {
  torch::Tensor starts, qlens, seq_lens, tables;  // contiguous int64 on the CPU
  int64_t R, max_blocks;

  // Checked against q's T rows and a cache of nb blocks of bs tokens.
  static ChunkArgs make(const torch::Tensor& starts, const torch::Tensor& qlens, const torch::Tensor& seq_lens,
                        const torch::Tensor& block_tables, int64_t T, int64_t bs, int64_t nb) {
    ChunkArgs a{starts.contiguous(), qlens.contiguous(), seq_lens.contiguous(), block_tables.contiguous(), 0, 0};
    for (const auto& x : {a.starts, a.qlens, a.seq_lens, a.tables})
      TORCH_CHECK(x.scalar_type() == at::kLong && x.device().is_cpu(),
                  "starts/qlens/seq_lens/block_tables: int64 on the CPU");
    a.R = a.starts.numel();
    TORCH_CHECK(a.qlens.numel() == a.R && a.seq_lens.numel() == a.R && a.tables.dim() == 2 && a.tables.size(0) == a.R,
                "one row per request");
    a.max_blocks = a.tables.size(1);
    for (int64_t r = 0; r < a.R; ++r) {
      const int64_t s = a.start(r), n = a.qlen(r), len = a.seq_len(r);
      TORCH_CHECK(s >= 0 && n > 0 && s + n <= T && len >= n, "a request outside q's rows or shorter than its queries");
      TORCH_CHECK((len + bs - 1) / bs <= a.max_blocks, "a block table shorter than its request");
      const int64_t* table = a.table(r);
      for (int64_t b = 0; b < (len + bs - 1) / bs; ++b)
        TORCH_CHECK(table[b] >= 0 && table[b] < nb, "a block id outside the cache");
    }
    return a;
  }

  int64_t start(int64_t r) const { return starts.data_ptr<int64_t>()[r]; }
  int64_t qlen(int64_t r) const { return qlens.data_ptr<int64_t>()[r]; }
  int64_t seq_len(int64_t r) const { return seq_lens.data_ptr<int64_t>()[r]; }
  const int64_t* table(int64_t r) const { return tables.data_ptr<int64_t>() + r * max_blocks; }
};
