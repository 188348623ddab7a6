# oneDNN's pre-packed float linears through the server (BENCHMARKS.md section 32): SmolLM2-135M-Instruct as the anchors'
# bf16 HF directory, pagedserve with and without packing (PAGEDSERVE_NO_ONEDNN_PACK=1), vLLM CPU bf16 beside it, vLLM's
# client via ../shared/anchors/serve_compare.sh, 64 streams and 1 stream, back to back in one window.
A=$HOME/.cache/pagedserve-anchors
S=$(cd "$(dirname "$0")" && pwd)/../../shared/anchors/serve_compare.sh
run() { echo "== $1 conc $2"; CONC=$2 NPROMPTS=$3 bash "$S" | tail -1; }
for conc in "64 64" "1 8"; do
  set -- $conc
  PAGEDSERVE_MODEL=$A/models/smollm2 PAGEDSERVE_ARGS="--dtype bfloat16" SYSTEM=pagedserve run "pagedserve bf16 packed" $1 $2
  PAGEDSERVE_NO_ONEDNN_PACK=1 PAGEDSERVE_MODEL=$A/models/smollm2 PAGEDSERVE_ARGS="--dtype bfloat16" SYSTEM=pagedserve run "pagedserve bf16 F.linear" $1 $2
  SYSTEM=vllm run "vllm bf16" $1 $2
done
