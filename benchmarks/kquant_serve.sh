#!/usr/bin/env bash
# Batch-1 serving of a K-quant GGUF (BENCHMARKS sections 49, 54): pagedserve's server against
# llama.cpp's on the same file, with vLLM's own client as ../shared/anchors/serve_compare.sh drives
# it (random 256 in / 128 out, ignore_eos, NPROMPTS prompts one at a time), alternating ROUNDS times.
# serve_compare.sh serves the default model only; this runs its client command on MODEL (default:
# kquant_decode.py's synthetic 0.9 B Q4_K_M mix, written by `kquant_decode.py --out`; it has
# SmolLM2's vocabulary, so SmolLM2's tokenizer drives the client). Needs the anchors
# (setup_anchors.sh, setup_llamacpp.sh; ANCHORS_DIR: their folder, default ../shared/anchors beside
# the checkout). Run from the project's root; one JSON line a run.
#   MODEL=/tmp/q4k.gguf ROUNDS=2 NPROMPTS=6 bash benchmarks/kquant_serve.sh
# The AVX2 path (section 56): PAGEDSERVE_CPU_ISA=avx2 and LLAMA_BIN=<a llama.cpp build's bin folder
# configured with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF>.
set -u
ROOT=${ANCHORS_ROOT:-$HOME/.cache/pagedserve-anchors}
MODEL=${MODEL:-/tmp/q4k.gguf}; ROUNDS=${ROUNDS:-2}; NP=${NPROMPTS:-6}; PORT=${PORT:-8741}
TOK=$ROOT/models/smollm2
LB=${LLAMA_BIN:-$(ls -d "$ROOT"/llamacpp/*/vendor/llama.cpp/build/bin 2>/dev/null | head -1)}
CLIENT=${ANCHORS_DIR:-$(cd "$(dirname "$0")/../../shared/anchors" 2>/dev/null && pwd)}/vllm_bench_serve.py
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -f "$MODEL" ] || { echo "no $MODEL: write it with benchmarks/kquant_decode.py --out $MODEL"; exit 2; }
[ -x "$LB/llama-server" ] && [ -f "$CLIENT" ] || { echo "anchors missing: run ../shared/anchors/setup_anchors.sh and setup_llamacpp.sh"; exit 2; }

wait_up() {
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1 && return 0; sleep 1; done
  return 1
}
client() {  # $1: the system's name
  local out; out=$(mktemp -d)
  "$ROOT/venv/bin/python" "$CLIENT" --backend openai --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
    --model smollm2 --tokenizer "$TOK" --dataset-name random --random-input-len 256 --random-output-len 128 \
    --num-prompts "$NP" --max-concurrency 1 --ignore-eos --seed 0 --request-rate inf \
    --save-result --result-dir "$out" --result-filename r.json >"$out/client.log" 2>&1
  python3 - "$out/r.json" "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keep = ["completed", "failed", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms"]
print(json.dumps({"system": sys.argv[2], **{k: round(r[k], 2) if isinstance(r[k], float) else r[k] for k in keep}}))
PY
}
serve() {  # $1: name, then the server's command line
  local name=$1; shift
  "$@" >"/tmp/kquant_serve_$name.log" 2>&1 &
  local pid=$!
  if wait_up; then client "$name"; else echo "$name did not start"; fi
  kill $pid; wait $pid 2>/dev/null
}
for _ in $(seq "$ROUNDS"); do
  # shellcheck disable=SC2086  # PAGEDSERVE_EXTRA: more server flags, e.g. "--weight-copies none"
  serve pagedserve .venv/bin/pagedserve serve "$MODEL" --port $PORT --served-model-name smollm2 --max-num-seqs 4 ${PAGEDSERVE_EXTRA:-}
  serve llamacpp "$LB/llama-server" -m "$MODEL" --port $PORT -a smollm2 -np 1 -c 2048 -t 2 -tb 2
done
