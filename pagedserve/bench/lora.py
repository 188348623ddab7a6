"""Many LoRA adapters in one batch beside the base model alone, same engine, same run.

    pagedserve bench lora [--model default] [--num-streams 64] [--num-adapters 8] [--rank 16]
        [--targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj]
        [--input-len 128] [--output-len 128] [--seed 0] [--output-json FILE]

The adapters are random PEFT LoRA directories (adapter_config.json +
adapter_model.safetensors, non-zero A and B) written for the model's shapes into a
temporary directory. One engine (enable_lora, max_loras = the adapter count, max_num_seqs
= the stream count) runs the same prompts, after one uncounted warm-up run, in alternating
rounds: the streams spread round-robin over the adapters (one step mixes them all), then
every stream on the base model; the best round of each counts. Prompts are
random token ids, outputs have exact lengths (ignore_eos, greedy), so both runs do the
same work; `ratio` is the adapters' output tokens/s over the base model's (goal >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_random_adapter(out_dir: str, dims, rank: int, targets: list[str], seed: int, alpha: float = 32.0) -> str:
    """A PEFT LoRA directory with random A and B (std 0.02 / 0.01) for a base of `dims`
    (pagedserve.lora.BaseDims)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(dims.num_layers):
        for t in targets:
            out, inp = dims.shape(t)
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
           "use_rslora": False, "use_dora": False, "fan_in_fan_out": False}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def _run(llm, prompts, sp, loras) -> dict:
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == len(prompts) * sp.max_tokens, "unexpected output lengths"
    return {"wall_s": round(wall, 3), "output_tokens": n_out, "output_tok_s": round(n_out / wall, 1)}


def _best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["output_tok_s"])


def run(args) -> dict:
    import random

    from pagedserve import LLM, LoRARequest, SamplingParams
    from pagedserve.lora import BaseDims

    llm = LLM(args.model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=max(16, args.rank),
              max_num_seqs=args.num_streams, seed=args.seed, **({"dtype": args.dtype} if args.dtype else {}))
    dims = BaseDims.of(llm.engine.model_config)
    tmp = tempfile.mkdtemp(prefix="pagedserve-bench-lora-")
    loras = [
        LoRARequest(f"a{i}", i + 1, write_random_adapter(os.path.join(tmp, f"a{i}"), dims, args.rank, args.targets, i))
        for i in range(args.num_adapters)
    ]
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]} for _ in range(args.num_streams)]
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    per_stream = [loras[i % len(loras)] for i in range(args.num_streams)]
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up, not counted: KV pages committed, kernels warm
    llm.generate(prompts[: len(loras)], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
                 use_tqdm=False, lora_request=loras)  # adapters read, slots filled
    rounds = {"base": [], "lora": []}
    for _ in range(args.rounds):  # alternating, so neither side gets the later (warmer) turns
        for name, which in (("lora", per_stream), ("base", None)):
            llm.reset_prefix_cache()
            rounds[name].append(_run(llm, prompts, sp, which))
    base, lora = (_best(rounds[k]) for k in ("base", "lora"))
    llm.shutdown()
    return {
        "bench": "lora",
        "model": args.model,
        "streams": args.num_streams,
        "adapters": args.num_adapters,
        "rank": args.rank,
        "targets": args.targets,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "base": base,
        "lora": lora,
        "ratio": round(lora["output_tok_s"] / base["output_tok_s"], 3),
        "rounds": {k: [r["output_tok_s"] for r in v] for k, v in rounds.items()},
        "cpu_threads": __import__("torch").get_num_threads(),
    }


# -- served: pagedserve beside vLLM CPU, one client (vLLM's bench serve), same adapters --------
ANCHORS = os.path.expanduser("~/.cache/pagedserve-anchors")


def _wait_up(url: str, proc, limit_s: float = 600.0) -> float:
    import urllib.request

    t0 = time.time()
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2)
            return time.time() - t0
        except OSError:
            if proc.poll() is not None or time.time() - t0 > limit_s:
                raise RuntimeError(f"server did not start (exit {proc.poll()})") from None
            time.sleep(1)


def _client(args, port: int, names: list[str] | None) -> dict:
    import subprocess

    out = tempfile.mkdtemp(prefix="pagedserve-bench-lora-client-")
    cmd = [args.anchors_python, args.client, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", "smollm2", "--tokenizer", args.hf_model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(args.num_streams), "--max-concurrency", str(args.num_streams),
           "--ignore-eos", "--seed", str(args.seed), "--request-rate", "inf", "--save-result", "--result-dir", out,
           "--result-filename", "r.json"]
    if names:
        cmd += ["--lora-modules", *names, "--lora-assignment", "round-robin"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    with open(os.path.join(out, "r.json")) as f:
        r = json.load(f)
    keep = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "median_tpot_ms")
    return {k: round(r[k], 2) if isinstance(r.get(k), float) else r.get(k) for k in keep}


def _served(args, system: str, modules: list[str], names: list[str], base_too: bool) -> dict:
    import subprocess
    import sys

    port = 8740 + (system == "vllm")
    lora_flags = ["--enable-lora", "--max-loras", str(len(names)), "--max-lora-rank", str(max(16, args.rank)),
                  "--lora-modules", *modules]
    if system == "pagedserve":
        cmd = [sys.executable, "-m", "pagedserve.frontend.cli", "serve", args.model, "--port", str(port),
               "--served-model-name", "smollm2", "--max-num-seqs", str(args.num_streams), "--no-dashboard"]
        env = dict(os.environ)
    else:
        cmd = [args.anchors_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_model,
               "--served-model-name", "smollm2", "--port", str(port), "--dtype", args.vllm_dtype,
               "--max-num-seqs", str(args.num_streams)]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    log = open(os.path.join(tempfile.gettempdir(), f"pagedserve-bench-lora-{system}.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd + lora_flags, env={**env, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=log)
    try:
        res = {"load_s": round(_wait_up(f"http://127.0.0.1:{port}", proc), 1)}
        _client(args, port, names)  # warm-up, not counted: adapters read, KV pages committed
        if base_too:
            res["base"] = _client(args, port, None)
        res["lora"] = _client(args, port, names)
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def run_served(args) -> dict:
    from pagedserve.executor.loader import load_hf_config_dict
    from pagedserve.executor.model_config import ModelConfig
    from pagedserve.lora import BaseDims

    dims = BaseDims.of(ModelConfig.from_hf_dict(load_hf_config_dict(args.hf_model)))
    tmp = tempfile.mkdtemp(prefix="pagedserve-bench-lora-")
    names = [f"a{i}" for i in range(args.num_adapters)]
    modules = [f"{n}={write_random_adapter(os.path.join(tmp, n), dims, args.rank, args.targets, i)}"
               for i, n in enumerate(names)]
    ours = _served(args, "pagedserve", modules, names, base_too=True)
    res = {"bench": "lora", "mode": "served", "streams": args.num_streams, "adapters": args.num_adapters,
           "rank": args.rank, "input_len": args.input_len, "output_len": args.output_len, "pagedserve": ours,
           "ratio_lora_over_base": round(ours["lora"]["output_throughput"] / ours["base"]["output_throughput"], 3)}
    if not args.no_vllm:
        theirs = _served(args, "vllm", modules, names, base_too=False)
        res["vllm"] = theirs
        res["ratio_vs_vllm"] = round(ours["lora"]["output_throughput"] / theirs["lora"]["output_throughput"], 3)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="pagedserve bench lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-streams", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", nargs="+", default=ALL_TARGETS)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating lora/base runs (the best of each counts)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--serve", action="store_true",
                    help="served: pagedserve serve (adapters and base) beside vLLM CPU --enable-lora, vLLM's client")
    ap.add_argument("--no-vllm", action="store_true", help="--serve: pagedserve only")
    ap.add_argument("--hf-model", default=os.path.join(ANCHORS, "models", "smollm2"),
                    help="--serve: the HF directory vLLM serves (and the client's tokenizer)")
    ap.add_argument("--anchors-python", default=os.path.join(ANCHORS, "venv", "bin", "python"))
    ap.add_argument("--client", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "anchors",
                                                     "vllm_bench_serve.py"))
    ap.add_argument("--vllm-dtype", default="bfloat16")
    args = ap.parse_args(argv)
    if args.serve:  # a SIGTERM (timeout) still stops the servers started (finally blocks run)
        import signal
        import sys

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run_served(args) if args.serve else run(args)
    print(json.dumps(res))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)
