"""Does reading a new LoRA adapter stall the streams already running? (issue 33's goal: by
no more than one step time.)

    python benchmarks/lora_load_stall.py [--streams 32] [--adapters 4] [--loads 3]

One engine (enable_lora, the default model) decodes `--streams` requests over the first
adapters; then, every 10 steps, a request of an adapter never seen before arrives, so its
safetensors are read on the loader thread and copied into a slot while the others decode.
Each engine step is timed (every running stream gets one token a step, so a step's time is
the streams' inter-token gap). Printed: the median step time outside loads, the slowest step
while an adapter was being read (from its request's arrival until it has its first token), and
stall = slowest - median, in units of the median step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.bench.lora import ALL_TARGETS, write_random_adapter
from pagedserve.lora import BaseDims


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4, help="adapters the streams run on (resident)")
    ap.add_argument("--loads", type=int, default=3, help="new adapters read while they run")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    n_slots = args.adapters + args.loads
    llm = LLM("default", enable_lora=True, max_loras=n_slots, max_lora_rank=args.rank, max_num_seqs=args.streams + args.loads)
    eng = llm.engine
    dims = BaseDims.of(eng.model_config)
    tmp = tempfile.mkdtemp(prefix="pagedserve-lora-stall-")
    loras = [LoRARequest(f"a{i}", i + 1, write_random_adapter(os.path.join(tmp, f"a{i}"), dims, args.rank, ALL_TARGETS, i))
             for i in range(n_slots)]
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(max_tokens=1_000, ignore_eos=True, temperature=0)
    for i in range(args.streams):
        eng.add_request(f"s{i}", {"prompt_token_ids": [rng.randrange(vocab) for _ in range(64)]}, sp,
                        lora_request=loras[i % args.adapters])
    for _ in range(30):  # prefills done, decoding
        eng.step()
    quiet, loading, pending = [], [], {}
    for step in range(10 * (args.loads + 1)):
        if step % 10 == 5 and step // 10 < args.loads:
            lora = loras[args.adapters + step // 10]
            eng.add_request(f"new{step}", {"prompt_token_ids": [5, 6, 7, 8]},
                            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), lora_request=lora)
            pending[f"new{step}"] = True
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        (loading if pending else quiet).append(dt)
        for o in outs:
            if o.request_id in pending and o.outputs and o.outputs[0].token_ids:
                del pending[o.request_id]
    med = statistics.median(quiet)
    worst = max(loading)
    print(json.dumps({"streams": args.streams, "adapters_running": args.adapters, "adapters_loaded": args.loads,
                      "median_step_ms": round(med * 1e3, 1), "worst_step_while_loading_ms": round(worst * 1e3, 1),
                      "stall_steps": round((worst - med) / med, 2), "steps_while_loading": len(loading)}))
    llm.shutdown()


if __name__ == "__main__":
    main()
