"""The C++ decode attention kernel alone (executor/attention/csrc/paged_decode.cpp), float32:
30 layers' worth of calls at SmolLM2's shapes (9 query heads, 3 KV heads, head size 64,
block size 16), K/V spread over 8 caches of ~31 MB each so a layer's K/V come from memory as
in a real 64-stream step. Prints one JSON line.

    .venv/bin/python benchmarks/attention_decode.py [--context 320] [--random-blocks]
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedserve.bench.forward import _median_time
from pagedserve.executor.attention import cpu_kernels


def median_ms(fn, rounds: int) -> float:
    return _median_time(fn, rounds) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--random-blocks", action="store_true", help="block tables in random order")
    a = ap.parse_args()
    m = cpu_kernels.load()
    torch.manual_seed(0)
    n, h, kvh, d, bs, L, layers = 64, 9, 3, 64, 16, a.context, 30
    nblk = -(-L // bs)
    nb = n * nblk + 1
    order = torch.randperm(nb - 1) if a.random_blocks else torch.arange(nb - 1)
    bt = (order[: n * nblk].view(n, nblk) + 1).long()
    caches = [(torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)) for _ in range(8)]

    def step(rows: int, lens: torch.Tensor, tables: torch.Tensor) -> None:
        q = torch.randn(rows, h, d)
        for i in range(layers):
            k, v = caches[i % 8]
            m.paged_decode(q, k, v, tables, lens, d**-0.5)

    res = {}
    res["rows64_ms"] = median_ms(lambda: step(n, torch.full((n,), L, dtype=torch.long), bt), 7)
    verify_lens = torch.arange(L - 4, L + 1).long()  # one request's last token and 4 guesses
    res["verify5_ms"] = median_ms(lambda: step(5, verify_lens, bt[:1].repeat(5, 1)), 11)
    res["rows1_ms"] = median_ms(lambda: step(1, verify_lens[-1:], bt[:1]), 11)
    kv_bytes = layers * n * L * kvh * d * 2 * 4
    print(
        json.dumps(
            {
                "bench": "attention_decode",
                "layers": layers,
                "context": L,
                "random_blocks": a.random_blocks,
                **{k: round(v, 2) for k, v in res.items()},
                "rows64_kv_gb_s": round(kv_bytes / res["rows64_ms"] / 1e6, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
