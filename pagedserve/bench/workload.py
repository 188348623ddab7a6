"""The benchmarks' shared workload: random-token prompts with exact output lengths, or a dataset."""

from __future__ import annotations

import argparse
import json
import random


def add_workload_args(ap: argparse.ArgumentParser, num_requests: int = 128) -> None:
    ap.add_argument("--num-requests", type=int, default=num_requests)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument(
        "--dataset", default=None, help='JSON list of {"prompt" or "prompt_token_ids", "output_len"}'
    )


def make_workload(a, vocab: int, tokenizer=None) -> list[tuple[list[int], int]]:
    if a.dataset:
        with open(a.dataset) as f:
            items = json.load(f)
        out = []
        for i, it in enumerate(items):
            if "prompt_token_ids" in it:
                ids = list(it["prompt_token_ids"])
            elif "prompt" in it and tokenizer is not None:
                ids = tokenizer.encode(it["prompt"])
            else:
                raise ValueError(f"dataset item {i} needs 'prompt' or 'prompt_token_ids'")
            out.append((ids, int(it["output_len"])))
        return out[: a.num_requests] if a.num_requests else out
    rng = random.Random(a.seed)
    lo, hi = a.input_len
    olo, ohi = a.output_len
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(olo, ohi))
        for _ in range(a.num_requests)
    ]
