"""Forward throughput: pagedserve's engine step beside transformers' forward, same run.

    python -m pagedserve.bench.forward [--model default] [--dtypes float32 bfloat16]
        [--batches 1 8 32 64] [--context 256] [--prefill-len 512] [--steps 8]

Prefill: tokens/s for one prompt of --prefill-len tokens. Decode: tokens/s at each batch
size with --context tokens already cached per sequence (pagedserve: one full engine
step = schedule + paged forward + sample + update; transformers: one forward of
[B, 1] tokens over its DynamicCache, greedy argmax). One JSON line per measurement,
with the ratio pagedserve / transformers.

    python -m pagedserve.bench.forward --profile [--dtypes bfloat16] [--batches 1 64] [--context 256] [--steps 10]

Where the time of a decode step goes, on the ModelRunner alone (no scheduler): per dtype
(--dtypes) and batch size, steps alternate between the fused C++ ops and their PyTorch
references (same process, interleaved, so a noisy machine hits both alike); each line gives the median
step, its split (input preparation, forward, logits, sampling) and the torch profiler's
top operators (what runs outside them, e.g. the C++ attention call, shows as the rest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedserve.bench.timing import sample_times


def _median_time(fn, steps: int, warmup: int = 1) -> float:
    return statistics.median(sample_times(fn, steps, warmup))


def bench_pagedserve(model: str, dtype: str, batches, context: int, prefill_len: int, steps: int) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=max(2048, prefill_len))
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    res = {}
    # prefill: a fresh 512-token prompt each time (no cache hits), sampling its first token
    n = [0]

    def prefill():
        n[0] += 1
        ids = [(n[0] * 7919 + j * 31) % (vocab - 100) + 100 for j in range(prefill_len)]
        eng.add_request(f"p{n[0]}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()

    res["prefill"] = prefill_len / _median_time(prefill, max(3, steps // 2))
    for b in batches:
        for i in range(b):
            ids = [(i * 131 + j * 17) % (vocab - 100) + 100 for j in range(context)]
            eng.add_request(
                f"d{b}-{i}",
                {"prompt_token_ids": ids},
                SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0),
            )
        sched = eng.engine_core.scheduler
        while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            eng.step()  # prefill everything (not timed): from here on, every step is B decodes
        res[f"decode_b{b}"] = b / _median_time(eng.step, steps)
        for i in range(b):
            eng.abort_request(f"d{b}-{i}")
    return res


@torch.inference_mode()
def bench_hf(model_dir: str, dtype: str, batches, context: int, prefill_len: int, steps: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    vocab = m.config.vocab_size
    res = {}
    ids = torch.tensor([[(j * 31) % (vocab - 100) + 100 for j in range(prefill_len)]])
    res["prefill"] = prefill_len / _median_time(
        lambda: m(ids, use_cache=True).logits[:, -1].argmax(-1), max(3, steps // 2)
    )
    for b in batches:
        prompt = torch.tensor(
            [[(i * 131 + j * 17) % (vocab - 100) + 100 for j in range(context)] for i in range(b)]
        )
        cache = DynamicCache()
        out = m(prompt, past_key_values=cache, use_cache=True)
        state = {"tok": out.logits[:, -1].argmax(-1, keepdim=True), "pos": context}

        def decode(cache=cache, state=state, b=b):
            o = m(
                state["tok"],
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.full((b, 1), state["pos"]),
            )
            state["tok"] = o.logits[:, -1].float().argmax(-1, keepdim=True)
            state["pos"] += 1

        res[f"decode_b{b}"] = b / _median_time(decode, steps)
    return res


class _DecodeDriver:
    """B requests with `context` cached tokens each, then decode steps straight through
    ModelRunner.execute_model (greedy), blocks handed out as a scheduler would."""

    def __init__(self, runner, batch: int, context: int, block_size: int) -> None:
        from pagedserve.messages import CachedRequestData, NewRequestData, SchedulerOutput
        from pagedserve.sampling_params import SamplingParams

        self.runner, self.bs, self.SR, self.SO = runner, block_size, CachedRequestData, SchedulerOutput
        vocab = runner.vocab_size
        p = SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0)
        reqs, self.state, nxt = [], {}, 1
        for i in range(batch):
            ids = [(i * 131 + j * 17) % (vocab - 100) + 100 for j in range(context)]
            nb = -(-context // block_size)
            reqs.append(
                NewRequestData(
                    req_id=f"d{i}",
                    token_ids=ids,
                    num_computed_tokens=0,
                    block_ids=list(range(nxt, nxt + nb)),
                    sample=True,
                    sampling_params=p,
                    prompt_token_ids=ids,
                    output_token_ids=[],
                )
            )
            nxt += nb
            self.state[f"d{i}"] = [context, 0]
        self.next_block = nxt
        self._apply(runner.execute_model(SchedulerOutput(reqs, batch * context)))

    def _apply(self, out) -> None:
        for rid, tok in out.sampled_token_ids.items():
            self.state[rid][1] = tok  # positions advance in step()

    def step(self) -> None:
        reqs = []
        for rid, st in self.state.items():
            new = []
            if st[0] % self.bs == 0:
                new, self.next_block = [self.next_block], self.next_block + 1
            reqs.append(
                self.SR(req_id=rid, token_ids=[st[1]], num_computed_tokens=st[0], block_ids=new, sample=True)
            )
            st[0] += 1
        self._apply(self.runner.execute_model(self.SO(reqs, len(reqs))))

    def finish(self) -> None:
        self.runner.execute_model(self.SO([], 0, finished_req_ids=set(self.state)))


def profile_decode(model: str, dtype: str, batches, context: int, steps: int, top: int = 8) -> None:
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.executor import ops
    from pagedserve.executor.loader import load_hf_config_dict, resolve_model_path
    from pagedserve.executor.model_config import ModelConfig
    from pagedserve.executor.model_runner import ModelRunner

    path = resolve_model_path(model)
    cfg = ModelConfig.from_hf_dict(load_hf_config_dict(path))
    runner = ModelRunner(path, cfg, dtype=dtype, device="cpu")
    bs = 16
    need = max(batches) * (-(-(context + 4 * steps + 8) // bs)) + 2
    runner.initialize_kv_cache(need, bs)
    timers: dict[str, list[float]] = {}

    def timed(obj, attr, key):
        fn = getattr(obj, attr)

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            timers.setdefault(key, []).append(time.perf_counter() - t)
            return out

        setattr(obj, attr, wrapper)

    timed(runner.input_batch, "prepare", "prepare")
    timed(runner.model, "forward", "forward")
    timed(runner.model, "compute_logits", "logits")
    timed(runner.sampler, "greedy", "sample")
    for b in batches:
        drv = _DecodeDriver(runner, b, context, bs)
        for _ in range(2):
            drv.step()
        res: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
        for _ in range(steps):
            for fused in (True, False):
                ops.enabled = fused
                timers.clear()
                t = time.perf_counter()
                drv.step()
                timers["step"] = [time.perf_counter() - t]
                for k, v in timers.items():
                    res[fused].setdefault(k, []).append(sum(v))
        ops.enabled = True
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                drv.step()
        table = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        top_ops = {e.key: round(e.self_cpu_time_total / 3e3, 2) for e in table[:top]}
        drv.finish()
        med = {f: {k: round(statistics.median(v) * 1e3, 2) for k, v in res[f].items()} for f in res}
        print(
            json.dumps(
                {
                    "bench": "decode_step_profile",
                    "model": model,
                    "dtype": dtype,
                    "batch": b,
                    "context": context,
                    "fused_ms": med[True],
                    "pytorch_ms": med[False],
                    "speedup": round(med[False]["step"] / med[True]["step"], 3),
                    "isa": ops.isa(),
                    "top_ops_fused_ms_per_step": top_ops,
                }
            ),
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="decode-step time split, fused ops vs PyTorch")
    a = ap.parse_args(argv)
    if a.profile:
        for dtype in a.dtypes:
            profile_decode(a.model, dtype, a.batches, a.context, a.steps)
        return
    from pagedserve.executor.loader import resolve_model_path

    model_dir = resolve_model_path(a.model)
    torch.set_num_threads(torch.get_num_threads())
    for dtype in a.dtypes:
        ours = bench_pagedserve(a.model, dtype, a.batches, a.context, a.prefill_len, a.steps)
        hf = bench_hf(model_dir, dtype, a.batches, a.context, a.prefill_len, a.steps)
        for k in ours:
            print(
                json.dumps(
                    {
                        "bench": "forward",
                        "model": a.model,
                        "dtype": dtype,
                        "what": k,
                        "context": a.context if k.startswith("decode") else 0,
                        "pagedserve_tok_s": round(ours[k], 1),
                        "transformers_tok_s": round(hf[k], 1),
                        "ratio": round(ours[k] / hf[k], 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
