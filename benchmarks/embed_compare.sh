# BENCHMARKS.md sections 29 and 37: pagedserve and vLLM CPU /v1/embeddings on the same bf16 model directory, same inputs;
# then offline LLM.embed beside sentence-transformers. Needs ../shared/anchors installed.
# PAGEDSERVE: the pagedserve command (default .venv/bin/pagedserve); this checkout's code runs
# (PYTHONPATH), so a git worktree without its own venv measures itself.
cd "$(dirname "$0")/.."; M=$HOME/.cache/pagedserve-anchors/models/smollm2; A=$HOME/.cache/pagedserve-anchors
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PS=${PAGEDSERVE:-.venv/bin/pagedserve}
# the server commits its KV cache at start (as vLLM's, which allocates VLLM_CPU_KVCACHE_SPACE zeroed)
echo "== pagedserve server"; timeout 600 $PS bench embed --model $M --num 512 2>&1 | tail -1
echo "== pagedserve server, --no-kv-cache-prefault (committed as blocks first fill)"
timeout 600 $PS bench embed --model $M --num 512 --server-arg=--no-kv-cache-prefault 2>&1 | tail -1
echo "== vllm server"
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 $A/venv/bin/python -m vllm.entrypoints.openai.api_server --model $M \
  --runner pooling --convert embed --served-model-name bench --port 8781 --dtype bfloat16 > /tmp/vllm_embed.log 2>&1 &
vp=$!
until curl -sf http://127.0.0.1:8781/v1/models >/dev/null; do sleep 2; kill -0 $vp || break; done
timeout 600 $PS bench embed --url http://127.0.0.1:8781 --served-model bench --num 512 2>&1 | tail -1
kill $vp; wait $vp
echo "== offline"; timeout 600 $PS bench embed --model $M --offline --num 256 2>&1 | tail -1
