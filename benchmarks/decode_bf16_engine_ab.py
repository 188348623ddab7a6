"""Engine decode steps with the vdpbf16ps decode attention (csrc/decode_bf16.h) against the float
kernel, switched in process every round (BENCHMARKS section 45): B requests of a C-token context
in a bfloat16 engine, prefilled untimed, then rounds of decode steps alternating the switch.

    .venv/bin/python benchmarks/decode_bf16_engine_ab.py [--model GGUF] [--batches 64 16 5 1] [--context 320]

Prints one JSON line per batch size: median ms per step for each kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 16, 5, 1])
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.executor.attention import cpu_kernels

    cpp = cpu_kernels.load()
    if cpp is None or not hasattr(cpp, "set_decode_bf16"):
        raise SystemExit("this module has no vdpbf16ps decode kernel (a CPU without AVX512-BF16)")
    llm = LLM(a.model, dtype="bfloat16", enable_prefix_caching=False)
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    steps_needed = a.rounds * 2 * 11 + 8
    for b in a.batches:
        for i in range(b):
            ids = [(i * 131 + j * 17) % (vocab - 100) + 100 for j in range(a.context)]
            params = SamplingParams(max_tokens=steps_needed, ignore_eos=True, temperature=0)
            eng.add_request(f"d{b}-{i}", {"prompt_token_ids": ids}, params)
        sched = eng.engine_core.scheduler
        while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            eng.step()  # prefill (not timed): from here on every step is b decodes
        ms = {"float_kernel": [], "bf16_kernel": []}
        k = 3 if b > 8 else 10
        try:
            for _ in range(a.rounds):
                for name, on in (("float_kernel", False), ("bf16_kernel", True)):
                    cpp.set_decode_bf16(on)
                    eng.step()
                    t = time.perf_counter()
                    for _ in range(k):
                        eng.step()
                    ms[name].append((time.perf_counter() - t) / k * 1e3)
        finally:
            cpu_kernels.sync_isa(cpp)
        med = {n: round(statistics.median(v), 2) for n, v in ms.items()}
        print(json.dumps({"batch": b, "context": a.context, "ms_per_step": med,
                          "ratio": round(med["float_kernel"] / med["bf16_kernel"], 3)}), flush=True)
        for i in range(b):
            eng.abort_request(f"d{b}-{i}")
        while eng.has_unfinished_requests():
            eng.step()


if __name__ == "__main__":
    main()
