#!/usr/bin/env bash
# The GPU check, prepared to run in one go (< 10 minutes) on one H200 through the device tool:
#   bash benchmarks/gpu_check.sh            (results and logs under $OUT, else benchmarks/results)
# 1) GPU tests: Triton kernels against the PyTorch backend, the engine with and without CUDA
#    graphs against transformers on tiny checkpoints, bf16 tolerances, memory profiling;
# 2) a random-weight Llama-3-8B-shaped model in bf16: decode tok/s at batch 1, 32, 256 with
#    and without CUDA graphs, prefill tok/s, each against the measured roofline;
# 3) with 2+ GPUs only (else it says it skipped): tensor parallelism over NCCL, TP=2 against
#    one GPU, and its per-step communication cost (benchmarks/tp_comm.py).
# Uses the machine's own torch / triton / transformers; needs nothing from a registry.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu_check.log"
timeout 270 $PY -m pytest -q -x -p no:cacheprovider tests/test_triton_backend.py tests/test_gpu.py tests/test_cuda_graphs.py \
  2>&1 | tee -a "$OUT/gpu_check.log"
tests_rc=${PIPESTATUS[0]}
timeout 270 $PY benchmarks/gpu_bench.py --out "$OUT/gpu_results.json" 2>&1 | tee -a "$OUT/gpu_check.log"
bench_rc=${PIPESTATUS[0]}
# 3) tensor parallelism (NCCL), only with 2+ GPUs: TP=2 against one GPU on tiny checkpoints,
#    then the per-step communication cost of a random 8-head Llama at TP 1 and 2.
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
tp_rc=0
if [ "$ngpu" -ge 2 ]; then
  echo "== tensor parallelism on $ngpu GPUs ==" | tee -a "$OUT/gpu_check.log"
  timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/test_tensor_parallel.py -k two_gpus \
    2>&1 | tee -a "$OUT/gpu_check.log"
  tp_rc=${PIPESTATUS[0]}
  timeout 120 $PY benchmarks/tp_comm.py --random-llama --device cuda --tp 1 2 --batches 1 32 \
    2>&1 | tee "$OUT/tp_comm.jsonl" | tee -a "$OUT/gpu_check.log"
else
  echo "== tensor parallelism: skipped ($ngpu GPU; needs 2 or more) ==" | tee -a "$OUT/gpu_check.log"
fi
echo "tests rc=$tests_rc bench rc=$bench_rc tp rc=$tp_rc" | tee -a "$OUT/gpu_check.log"
exit $(( tests_rc || bench_rc || tp_rc ))
