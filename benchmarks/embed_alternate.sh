# BENCHMARKS.md section 38: /v1/embeddings, pagedserve and vLLM CPU bf16 alternating ROUNDS times
# (fresh servers each), N seeded inputs of 16-256 tokens (pagedserve bench embed drives both).
# Needs ../shared/anchors installed. N=1024 ROUNDS=2 by default.
cd "$(dirname "$0")/.."; M=$HOME/.cache/pagedserve-anchors/models/smollm2; A=$HOME/.cache/pagedserve-anchors
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PS=${PAGEDSERVE:-.venv/bin/pagedserve}; N=${N:-1024}
for round in $(seq 1 "${ROUNDS:-2}"); do
  echo "== pagedserve round $round"; timeout 600 $PS bench embed --model $M --num $N 2>&1 | tail -1
  echo "== vllm round $round"
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 $A/venv/bin/python -m vllm.entrypoints.openai.api_server --model $M \
    --runner pooling --convert embed --served-model-name bench --port 8781 --dtype bfloat16 > /tmp/vllm_embed.log 2>&1 &
  vp=$!
  until curl -sf http://127.0.0.1:8781/v1/models >/dev/null; do sleep 2; kill -0 $vp || break; done
  timeout 600 $PS bench embed --url http://127.0.0.1:8781 --served-model bench --num $N 2>&1 | tail -1
  kill $vp; wait $vp
done
