"""Quantized-weight measurements (JSON on stdout), A/B interleaved in one process.

python -m pagedserve.bench.quant tpot    [--model default] [--tokens 128] [--rounds 5]
      batch-1 decode time per output token, packed vs dequantized float32 (quantization="none")
python -m pagedserve.bench.quant kernels [--rounds 20]
      one linear layer at decode/prefill row counts: packed kernels vs float32 F.linear vs
      torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu
python -m pagedserve.bench.quant isa     [--isas avx2,avx512,avx512_vnni] [--variants q4_1_act_q8,...]
      the packed kernels under each instruction-set path in turn (PAGEDSERVE_CPU_ISA's names),
      interleaved in one process: microseconds per call and the ratios to the first path
python -m pagedserve.bench.quant bf16    [--shapes ...] [--rows 16,64,256,1024] [--threads N]
      a bfloat16 model's packed layer (bf16 in, bf16 out) at many rows: the float path (before),
      the vdpbf16ps kernel, oneDNN over split bf16 weight tiles, and F.linear over already
      dequantized bf16 weights (oneDNN's best case: no dequantization), interleaved
python -m pagedserve.bench.quant rss     [--model default] [--quantization ...]
      resident memory of an engine after start and one generation
python -m pagedserve.bench.quant ppl     [--variants default,gguf_q8,none] [--kv-cache-dtypes auto,fp8]
                                         [--dtype float32 | bfloat16] [--bf16-rows N]
      perplexity of the default GGUF on a public-domain text (the Gettysburg Address and the
      opening of the Declaration of Independence), each quantization mode beside transformers
      loading the same GGUF (the numerics contract: within 1%)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedserve.bench.timing import sample_times


def _tpot(llm, tokens: int, prompt: str) -> tuple[float, float]:
    from pagedserve import SamplingParams

    sp1 = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    spn = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompt, sp1, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(prompt, spn, use_tqdm=False)
    t2 = time.perf_counter()
    return (t2 - t1 - (t1 - t0)) / tokens, t1 - t0


def cmd_tpot(args) -> dict:
    from pagedserve import LLM

    variants = [q.strip() for q in args.variants.split(",")]
    llms = {}
    for v in variants:
        q = None if v == "default" else v
        llms[v] = LLM(args.model, dtype="float32", num_kv_blocks=256, quantization=q)
        _tpot(llms[v], 8, args.prompt)  # warm up
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            samples[v].append(_tpot(llms[v], args.tokens, args.prompt)[0] * 1e3)
    med = {v: statistics.median(s) for v, s in samples.items()}
    base = variants[-1]
    return {
        "bench": "tpot",
        "model": args.model,
        "batch": 1,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "median_tpot_ms": med,
        "all_ms": samples,
        f"speedup_vs_{base}": {v: med[base] / med[v] for v in variants},
    }


def _time(fn, rounds: int) -> float:
    return statistics.median(sample_times(fn, rounds)) * 1e6


def _kernel_fns(x, w, q8, q4, w8, s8, w4, sz4) -> dict:
    import torch
    import torch.nn.functional as F

    from pagedserve.executor.quant import kernels

    out = torch.empty(x.shape[0], w.shape[0])
    fns = {
        "float32_linear": lambda: F.linear(x, w),
        "packed_q8_0": lambda: kernels.gemm(x, q8.data, q8.qtype, out),
        "packed_q4_1": lambda: kernels.gemm(x, q4.data, q4.qtype, out),
        "packed_q8_0_act_q8": lambda: kernels.gemm(x, q8.data, q8.qtype, out, act_q8=True),
        "packed_q4_1_act_q8": lambda: kernels.gemm(x, q4.data, q4.qtype, out, act_q8=True),
        "torch_int8pack_mm": lambda: torch._weight_int8pack_mm(x, w8, s8),
    }
    if w4 is not None:
        fns["torch_int4pack_mm_g32"] = lambda: torch._weight_int4pack_mm_for_cpu(x, w4, 32, sz4)
    return fns


def cmd_kernels(args) -> dict:
    import torch

    from pagedserve.executor.quant import kernels
    from pagedserve.executor.quant.formats import quantize_q4_1, quantize_q8_0

    torch.manual_seed(0)
    rows = []
    for n, k in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        w = torch.randn(n, k) * 0.02
        q8, q4 = quantize_q8_0(w), quantize_q4_1(w)
        w8 = torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
        s8 = (w.abs().amax(1) / 127).float()
        w4 = None
        try:
            wq = torch.randint(0, 16, (n, k), dtype=torch.int32)
            w4 = torch._convert_weight_to_int4pack_for_cpu(wq, 1)
            sz4 = torch.rand(k // 32, n, 2)
        except Exception:  # noqa: BLE001
            w4 = None
        for m in [int(x) for x in args.rows.split(",")]:
            fns = _kernel_fns(torch.randn(m, k), w, q8, q4, w8, s8, w4, sz4 if w4 is not None else None)
            res = {name: None for name in fns}
            for _ in range(args.rounds):  # interleaved
                for name, fn in fns.items():
                    t = _time(fn, 3)
                    res[name] = min(res[name], t) if res[name] is not None else t
            rows.append({"N": n, "K": k, "M": m, "us": {a: round(b, 1) for a, b in res.items()}})
    return {
        "bench": "quant_kernels",
        "isa": kernels.current_isa(),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def _isa_fns(x, out, packed: dict, variants: list[str]) -> dict:
    """Variants "<format>" (float activations), "<format>_act_q8" (int8 activations) and
    "<format>_bf16" (a bfloat16 model's layer: bf16 activations in and out); formats q8_0, q4_1."""
    from pagedserve.executor.quant import kernels

    xb, n, fns = x.bfloat16(), out.shape[1], {}
    for v in variants:
        p = packed[v.split("_act")[0].removesuffix("_bf16")]
        if v.endswith("_act_q8"):
            fns[v] = lambda p=p: kernels.gemm(x, p.data, p.qtype, out, act_q8=True)
        elif v.endswith("_bf16"):
            fns[v] = lambda p=p: kernels.load().qlinear(xb, [p.data], [p.qtype], [0], n, None, False)
        else:
            fns[v] = lambda p=p: kernels.gemm(x, p.data, p.qtype, out)
    return fns


def cmd_isa(args) -> dict:
    import torch

    from pagedserve.executor.quant import kernels
    from pagedserve.executor.quant.formats import quantize_q4_1, quantize_q8_0

    torch.manual_seed(0)
    isas = [i.strip() for i in args.isas.split(",") if i.strip() in kernels.available_isas()]
    variants = [v.strip() for v in args.variants.split(",")]
    rows = []
    prev = kernels.current_isa()
    try:
        for n, k in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
            w = torch.randn(n, k) * 0.02
            packed = {"q8_0": quantize_q8_0(w), "q4_1": quantize_q4_1(w)}
            for m in [int(x) for x in args.rows.split(",")]:
                x = torch.randn(m, k)
                out = torch.empty(m, n)
                fns = _isa_fns(x, out, packed, variants)
                res: dict = {}
                for _ in range(args.rounds):  # interleaved: every path and variant each round
                    for isa in isas:
                        kernels.set_isa(isa)
                        for v, fn in fns.items():
                            t = _time(fn, 3)
                            key = f"{v}@{isa}"
                            res[key] = min(res.get(key, t), t)
                ratio = {
                    f"{v}@{isa}": round(res[f"{v}@{isas[0]}"] / res[f"{v}@{isa}"], 3) for v in fns for isa in isas[1:]
                }
                us = {a: round(b, 1) for a, b in res.items()}
                rows.append({"N": n, "K": k, "M": m, "us": us, f"speedup_vs_{isas[0]}": ratio})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        kernels.set_isa(prev)
    return {"bench": "quant_isa", "isas": isas, "threads": torch.get_num_threads(), "rows": rows}


def cmd_bf16(args) -> dict:
    import torch
    import torch.nn.functional as F

    from pagedserve.executor.quant import kernels
    from pagedserve.executor.quant.formats import quantize_q4_1, quantize_q8_0

    if args.threads:
        torch.set_num_threads(args.threads)
    mod = kernels.load()
    torch.manual_seed(0)
    modes = {"float_path": (1 << 30, 1 << 30), "bf16_kernel": (1, 1 << 30), "bf16_onednn_split": (1, 1)}
    rows = []
    old = kernels.set_bf16_rows(12), kernels.set_bf16_onednn_rows(1 << 30)
    try:
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = torch.randn(n, k) * 0.02
            p = quantize_q8_0(w) if n > 8192 else quantize_q4_1(w)  # the LM head is Q8_0 in the default GGUF
            wb = p.dequantize().bfloat16()
            for m in [int(v) for v in args.rows.split(",")]:
                xb = torch.randn(m, k).bfloat16()
                res: dict = {}
                for _ in range(args.rounds):
                    for name, (a, b) in modes.items():
                        kernels.set_bf16_rows(a)
                        kernels.set_bf16_onednn_rows(b)
                        t = _time(lambda p=p, xb=xb, n=n: mod.qlinear(xb, [p.data], [p.qtype], [0], n, None, False), 3)
                        res[name] = min(res.get(name, t), t)
                    t = _time(lambda xb=xb, wb=wb: F.linear(xb, wb), 3)
                    res["dense_bf16_linear"] = min(res.get("dense_bf16_linear", t), t)
                gf = {a: round(2 * m * n * k / b / 1e3, 1) for a, b in res.items()}
                us = {a: round(b, 1) for a, b in res.items()}
                rows.append({"N": n, "K": k, "M": m, "type": "Q8_0" if n > 8192 else "Q4_1", "us": us, "gflops": gf})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        kernels.set_bf16_rows(old[0])
        kernels.set_bf16_onednn_rows(old[1])
    return {"bench": "quant_bf16", "isa": kernels.current_isa(), "threads": torch.get_num_threads(), "rows": rows}


def cmd_rss(args) -> dict:
    import gc

    from pagedserve import LLM, SamplingParams

    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def hwm_mb() -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    q = None if args.quantization == "default" else args.quantization
    before = rss_mb()
    llm = LLM(args.model, quantization=q)
    llm.generate("The capital of France is", SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    gc.collect()
    return {
        "bench": "rss",
        "model": args.model,
        "quantization": args.quantization,
        "rss_before_mb": round(before, 1),
        "rss_after_mb": round(rss_mb(), 1),
        "peak_rss_mb": round(hwm_mb(), 1),
    }


def cmd_demo(args) -> dict:
    from pagedserve import LLM, SamplingParams
    from pagedserve.frontend.demo import QUESTIONS
    from pagedserve.tokenizer import apply_chat_template

    variants = [q.strip() for q in args.variants.split(",")]
    llms = {
        v: LLM(args.model, num_kv_blocks=400, quantization=None if v == "default" else v) for v in variants
    }
    tok = llms[variants[0]].get_tokenizer()
    prompts = [
        {"prompt_token_ids": apply_chat_template(tok, [{"role": "user", "content": q}])} for q, _ in QUESTIONS
    ]
    params = [SamplingParams(max_tokens=n, temperature=0) for _, n in QUESTIONS]
    walls: dict[str, list[float]] = {v: [] for v in variants}
    gen = {}
    for _ in range(args.rounds):
        for v in variants:
            t = time.perf_counter()
            outs = llms[v].generate(prompts, params, use_tqdm=False)
            walls[v].append(time.perf_counter() - t)
            gen[v] = sum(len(o.outputs[0].token_ids) for o in outs)
    med = {v: statistics.median(w) for v, w in walls.items()}
    return {
        "bench": "demo",
        "model": args.model,
        "wall_s": walls,
        "generated_tokens": gen,
        "generated_tok_per_s": {v: gen[v] / med[v] for v in variants},
        f"speedup_vs_{variants[-1]}": {v: med[variants[-1]] / med[v] for v in variants},
    }


PUBLIC_DOMAIN_TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We are "
    "met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is altogether fitting and "
    "proper that we should do this. But, in a larger sense, we can not dedicate -- we can not consecrate -- we "
    "can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated it, far "
    "above our poor power to add or detract. The world will little note, nor long remember what we say here, but "
    "it can never forget what they did here. It is for us the living, rather, to be dedicated here to the "
    "unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to be here "
    "dedicated to the great task remaining before us -- that from these honored dead we take increased devotion "
    "to that cause for which they gave the last full measure of devotion -- that we here highly resolve that "
    "these dead shall not have died in vain -- that this nation, under God, shall have a new birth of freedom -- "
    "and that government of the people, by the people, for the people, shall not perish from the earth.\n\n"
    "When in the Course of human events, it becomes necessary for one people to dissolve the political bands "
    "which have connected them with another, and to assume among the powers of the earth, the separate and equal "
    "station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of "
    "mankind requires that they should declare the causes which impel them to the separation. We hold these "
    "truths to be self-evident, that all men are created equal, that they are endowed by their Creator with "
    "certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness."
)


def cmd_ppl(args) -> dict:
    """Perplexity from prompt logprobs (pagedserve) and from one forward of transformers over
    the same token ids; both models read the same GGUF file."""
    import math
    import os

    import torch
    import transformers

    from pagedserve import LLM, SamplingParams
    from pagedserve.model_files import default_model_path

    path = default_model_path() if args.model == "default" else args.model
    if args.bf16_rows is not None:
        from pagedserve.executor.quant import kernels

        kernels.set_bf16_rows(args.bf16_rows)
    out: dict = {"bench": "quant_ppl", "model": os.path.basename(path), "text": "gettysburg+declaration"}
    out["dtype"] = args.dtype
    if args.bf16_rows is not None:
        out["bf16_rows"] = args.bf16_rows
    ids = None
    for v in [q.strip() for q in args.variants.split(",")]:
        for kv in [k.strip() for k in args.kv_cache_dtypes.split(",")]:
            llm = LLM(
                path,
                dtype=args.dtype,
                quantization=None if v == "default" else v,
                enable_prefix_caching=False,
                kv_cache_dtype=kv,
            )
            if ids is None:
                ids = llm.get_tokenizer().encode(PUBLIC_DOMAIN_TEXT)
            params = SamplingParams(max_tokens=1, prompt_logprobs=0)
            (o,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
            lps = [d[t].logprob for t, d in zip(ids[1:], o.prompt_logprobs[1:])]
            out[f"ppl_{v}" + ("" if kv == "auto" else f"_kv_{kv}")] = round(math.exp(-sum(lps) / len(lps)), 4)
            del llm
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    lp = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    ref = math.exp(-float(lp.mean()))
    out["ppl_transformers"] = round(ref, 4)
    out["tokens"] = len(ids)
    for k in [k for k in out if k.startswith("ppl_") and k != "ppl_transformers"]:
        out[k.replace("ppl_", "vs_transformers_")] = round(out[k] / ref, 4)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pagedserve.bench.quant")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tpot")
    t.add_argument("--model", default="default")
    t.add_argument("--variants", default="default,none", help="quantization values; the last is the baseline")
    t.add_argument("--tokens", type=int, default=128)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    k = sub.add_parser("kernels")
    k.add_argument("--shapes", default="1536x576,576x1536,49152x576,2048x2048,5632x2048")
    k.add_argument("--rows", default="1,4,16,64")
    k.add_argument("--rounds", type=int, default=5)
    i = sub.add_parser("isa")
    i.add_argument("--isas", default="avx2,avx512,avx512_vnni", help="the first is the baseline")
    i.add_argument("--variants", default="q4_1_act_q8,q8_0_act_q8")
    i.add_argument("--shapes", default="1536x576,3072x576,576x1536,49152x576")
    i.add_argument("--rows", default="1,2,3,5,8,16,64,256")
    i.add_argument("--rounds", type=int, default=5)
    b = sub.add_parser("bf16")
    b.add_argument("--shapes", default="1536x576,3072x576,576x576,576x1536,49152x576")
    b.add_argument("--rows", default="16,64,256,1024")
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    d = sub.add_parser("demo")
    d.add_argument("--model", default="default")
    d.add_argument("--variants", default="default,none")
    d.add_argument("--rounds", type=int, default=2)
    r = sub.add_parser("rss")
    r.add_argument("--model", default="default")
    r.add_argument("--quantization", default="default")
    q = sub.add_parser("ppl")
    q.add_argument("--model", default="default", help="a GGUF file (transformers loads the same one)")
    q.add_argument("--variants", default="default,gguf_q8,none")
    q.add_argument("--dtype", default="float32", help="the engines' dtype (bfloat16: the bf16 products)")
    q.add_argument("--bf16-rows", type=int, default=None, help="bf16 products from this many rows (1e9: off)")
    q.add_argument("--kv-cache-dtypes", default="auto", help="e.g. auto,float16,fp8_e4m3: each with every variant")
    args = p.parse_args(argv)
    cmds = {"tpot": cmd_tpot, "kernels": cmd_kernels, "isa": cmd_isa, "bf16": cmd_bf16, "rss": cmd_rss, "demo": cmd_demo, "ppl": cmd_ppl}
    out = cmds[args.cmd](args)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
