#!/usr/bin/env bash
# The GPU check, prepared to run in one go (< 10 minutes) on one H200 through the device tool:
#   bash benchmarks/gpu_check.sh            (results and logs under $OUT, else benchmarks/results)
# 1) GPU tests: Triton kernels against the PyTorch backend, the engine with and without CUDA
#    graphs against transformers on tiny checkpoints, bf16 tolerances, memory profiling; the
#    engine's features on CUDA (preemption, chunked prefill, prefix hits, speculation, LoRA,
#    seeded sampling, logprobs: tests/e2e/test_gpu_engine.py);
# 2) a random-weight Llama-3-8B-shaped model in bf16: decode tok/s at batch 1, 32, 256 with
#    and without CUDA graphs, prefill tok/s, each against the measured roofline; then
#    benchmarks/gpu_profile.py's split of a decode step (gpu_profile.json / .log);
# 2b) the same model served over HTTP against LLM.generate (gpu_serve.json);
# 3) with 2+ GPUs only (else it says it skipped): tensor parallelism over NCCL, TP=2 against
#    one GPU, and its per-step communication cost (benchmarks/tp_comm.py).
# Uses the machine's own torch / triton / transformers; needs nothing from a registry. A
# dependency that machine lacks (pyzmq; the server's extras) travels as a wheel in .whl/ (the device tool's README).
# The CPU kernels are not built there (PAGEDSERVE_NO_CPP_KERNELS): CUDA tensors never use them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PAGEDSERVE_NO_CPP_KERNELS=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu_check.log"
timeout 240 $PY -m pytest -q -p no:cacheprovider --timeout 120 --durations 8 tests/executor/test_triton_backend.py \
  tests/executor/test_triton_ops.py tests/executor/test_triton_moe.py tests/executor/test_gpu.py tests/executor/test_cuda_graphs.py \
  tests/e2e/test_gpu_engine.py 2>&1 | tee -a "$OUT/gpu_check.log"
tests_rc=${PIPESTATUS[0]}
timeout 220 $PY benchmarks/gpu_bench.py --out "$OUT/gpu_results.json" 2>&1 | tee -a "$OUT/gpu_check.log"
bench_rc=${PIPESTATUS[0]}
# where a decode step's time goes (kernel table, host profile, decode tile A/B): informative, no rc
timeout 120 $PY benchmarks/gpu_profile.py --out "$OUT/gpu_profile.json" > "$OUT/gpu_profile.log" 2>&1
grep -E '^\{' "$OUT/gpu_profile.log" | tee -a "$OUT/gpu_check.log"
# 2b) served: the same 8B-shaped model behind `pagedserve serve` (HTTP, streaming, the engine core
#     in its own process), 512 requests of 256 prompt tokens and 128 output tokens all at once, against
#     the same workload through LLM.generate in one process (the server's ceiling). Needs the server's
#     extras (fastapi, uvicorn, pydantic: carried in .whl/ where the image lacks them).
if $PY -c "import fastapi, uvicorn, pydantic" 2>/dev/null; then
  mdir=$($PY -c "from benchmarks.gpu_bench import model_dir, LLAMA3_8B; print(model_dir(LLAMA3_8B))")
  timeout 240 $PY -m pagedserve.bench.serve --launch "$mdir" --dtype bfloat16 --server-arg=--load-format=dummy \
    --compare-offline --num-requests 512 --input-len 256 256 --output-len 128 128 --max-num-seqs 256 \
    --output-json "$OUT/gpu_serve.json" > "$OUT/gpu_serve.log" 2>&1
  echo "serve rc=$? $(tail -c 1500 "$OUT/gpu_serve.log")" | tee -a "$OUT/gpu_check.log"
else
  echo "== served: skipped (no fastapi/uvicorn/pydantic) ==" | tee -a "$OUT/gpu_check.log"
fi
# 3) tensor parallelism (NCCL), only with 2+ GPUs: TP=2 against one GPU on tiny checkpoints,
#    then the per-step communication cost of a random 8-head Llama at TP 1 and 2.
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
tp_rc=0
if [ "$ngpu" -ge 2 ]; then
  echo "== tensor parallelism on $ngpu GPUs ==" | tee -a "$OUT/gpu_check.log"
  timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/executor/test_tensor_parallel.py -k two_gpus \
    2>&1 | tee -a "$OUT/gpu_check.log"
  tp_rc=${PIPESTATUS[0]}
  timeout 120 $PY benchmarks/tp_comm.py --random-llama --device cuda --tp 1 2 --batches 1 32 \
    2>&1 | tee "$OUT/tp_comm.jsonl" | tee -a "$OUT/gpu_check.log"
else
  echo "== tensor parallelism: skipped ($ngpu GPU; needs 2 or more) ==" | tee -a "$OUT/gpu_check.log"
fi
echo "tests rc=$tests_rc bench rc=$bench_rc tp rc=$tp_rc" | tee -a "$OUT/gpu_check.log"
exit $(( tests_rc || bench_rc || tp_rc ))
