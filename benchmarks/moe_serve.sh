# the same random-weight Mixtral-shaped MoE (~0.9B total, ~0.28B active, bf16) through pagedserve and vLLM, vLLM's client, 32 streams
# (BENCHMARKS.md section 27). Needs ../shared/anchors installed (vLLM venv, SmolLM2's tokenizer).
A=$HOME/.cache/pagedserve-anchors; PORT=${PORT:-8761}
HERE=$(cd "$(dirname "$0")" && pwd)
M=$(mktemp -d); trap 'rm -rf "$M"' EXIT
cp "$A"/models/smollm2/tokenizer.json "$A"/models/smollm2/tokenizer_config.json "$M"/
cp "$HERE"/results/moe_serve_config.json "$M"/config.json
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
client() { $A/venv/bin/python "$HERE"/../../shared/anchors/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:$PORT \
  --endpoint /v1/completions --model moe --tokenizer $M --dataset-name random --random-input-len 128 --random-output-len 64 \
  --num-prompts $1 --max-concurrency $1 --ignore-eos --seed 0 2>&1 | grep -E "Output token throughput|Median TPOT|Median TTFT|Successful"; }
wait_up() { until curl -sf http://127.0.0.1:$PORT/v1/models >/dev/null; do sleep 2; kill -0 $1 || return 1; done; }
for sys in pagedserve vllm; do
  if [ $sys = pagedserve ]; then
    "$HERE"/../.venv/bin/pagedserve serve $M --load-format dummy --dtype bfloat16 --served-model-name moe --port $PORT --max-num-seqs 32 > /tmp/moe_$sys.log 2>&1 &
  else
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 $A/venv/bin/python -m vllm.entrypoints.openai.api_server --model $M --load-format dummy \
      --dtype bfloat16 --served-model-name moe --port $PORT --max-num-seqs 32 --max-model-len 2048 > /tmp/moe_$sys.log 2>&1 &
  fi
  pid=$!; wait_up $pid || { echo "$sys failed to start"; tail -5 /tmp/moe_$sys.log; continue; }
  for c in 1 32; do echo "== $sys conc $c"; client $c; done
  kill $pid; wait $pid
done
