#!/usr/bin/env bash
# Where the served path's time goes on a GPU: `pagedserve serve` on the 8B-shaped random model
# (as gpu_check.sh's served step), the same 512-request burst from `pagedserve bench serve
# --url`, and py-spy sampling the API process and the engine core process meanwhile (raw
# collapsed stacks: benchmarks/pyspy_summary.py summarizes them). py-spy and the server's
# extras travel as wheels in .whl/.
#   bash benchmarks/gpu_serve_profile.sh      (results under $OUT, else benchmarks/results)
#   SHAPE=TINY DTYPE=float32 OUT=/tmp/x bash benchmarks/gpu_serve_profile.sh   (the script itself, on a CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PAGEDSERVE_NO_CPP_KERNELS=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="/tmp/site/bin:$PATH"
fi
mdir=$($PY -c "from benchmarks.gpu_bench import model_dir, LLAMA3_8B, TINY; print(model_dir(${SHAPE:-LLAMA3_8B}))")
port=8391
$PY -m pagedserve.frontend.cli serve "$mdir" --port $port --served-model-name bench --log-level warning \
  --load-format dummy --dtype ${DTYPE:-bfloat16} --max-num-seqs 256 > "$OUT/serve_profile_server.log" 2>&1 &
srv=$!
for _ in $(seq 240); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.5; done
core=$(pgrep -P $srv -f spawn_main | head -1)
echo "server $srv core $core up after $SECONDS s" | tee "$OUT/serve_profile.log"
args=(--url http://127.0.0.1:$port --model bench --num-requests 512 --input-len 256 256 --output-len 128 128)
# the first burst warms up (and JIT-compiles); py-spy samples the second
timeout 120 $PY -m pagedserve.bench.serve "${args[@]}" > /dev/null 2>&1
py-spy record -p $srv -d 12 -r 100 -f raw -o "$OUT/pyspy_api.txt" > /dev/null 2>&1 &
py-spy record -p "$core" -d 12 -r 100 -f raw -o "$OUT/pyspy_core.txt" > /dev/null 2>&1 &
timeout 120 $PY -m pagedserve.bench.serve "${args[@]}" --output-json "$OUT/serve_profile.json" 2>&1 | tail -1 \
  | tee -a "$OUT/serve_profile.log"
wait_spy=0; while pgrep -x py-spy >/dev/null && [ $wait_spy -lt 20 ]; do sleep 1; wait_spy=$((wait_spy + 1)); done
kill $srv; wait $srv 2>/dev/null
ls -la "$OUT" | tee -a "$OUT/serve_profile.log"
