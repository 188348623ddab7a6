"""offline_ab.py's load (the default model, N random 256-token prompts at once, 128 sampled
tokens each) with packed-kernel settings A/B'd in one process: besides LLM(...) keyword
arguments a configuration may set `isa=` (the kernel path, PAGEDSERVE_CPU_ISA's names),
`bf16_rows=` and `bf16_onednn_rows=` (quant.kernels.set_bf16_rows / set_bf16_onednn_rows),
applied before each of its runs, so engines that differ only in these share the process.

    python benchmarks/kernel_ab.py --configs dtype=bfloat16 dtype=bfloat16,bf16_rows=1000000000 \\
        [--requests 64] [--rounds 2]
    python benchmarks/kernel_ab.py --configs quantization=gguf_q8,isa=avx2 quantization=gguf_q8,isa=avx512_vnni

Prints one JSON line per run, as offline_ab.py. The prefix cache is reset before every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_ab import parse_config, prompts, run  # noqa: E402

KERNEL_KEYS = ("isa", "bf16_rows", "bf16_onednn_rows")


def split(config: str) -> tuple[dict, dict]:
    kw = parse_config(config)
    return {k: v for k, v in kw.items() if k not in KERNEL_KEYS}, {k: v for k, v in kw.items() if k in KERNEL_KEYS}


_DEFAULTS: dict = {}


def apply(settings: dict) -> None:
    """The kernel settings of a configuration, the module's defaults for those it leaves out."""
    from pagedserve.executor.quant import kernels

    if not _DEFAULTS:
        _DEFAULTS["isa"] = kernels.current_isa()
        _DEFAULTS["bf16_rows"] = kernels.set_bf16_rows(0)
        _DEFAULTS["bf16_onednn_rows"] = kernels.set_bf16_onednn_rows(0)
    s = _DEFAULTS | settings
    kernels.set_isa(str(s["isa"]))
    kernels.set_bf16_rows(int(s["bf16_rows"]))
    kernels.set_bf16_onednn_rows(int(s["bf16_onednn_rows"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["dtype=bfloat16", "dtype=bfloat16,bf16_rows=1000000000"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    from pagedserve import LLM, SamplingParams

    llms = {}
    for c in a.configs:
        kw, settings = split(c)
        key = json.dumps(kw, sort_keys=True)
        llms[c] = llms.get(key) or LLM("default", **kw)  # one engine per distinct LLM(...)
        llms[key] = llms[c]
        apply(settings)
        llms[c].generate([{"prompt_token_ids": prompts(-1, 1)[0][:32]}], SamplingParams(max_tokens=8), use_tqdm=False)
    for r in range(a.rounds):
        work = prompts(r, a.requests)
        for c in a.configs if r % 2 == 0 else a.configs[::-1]:
            apply(split(c)[1])
            llms[c].reset_prefix_cache()  # configurations may share an engine: no hits from the last run
            print(json.dumps({"config": c, "round": r} | run(llms[c], work)), flush=True)


if __name__ == "__main__":
    main()
