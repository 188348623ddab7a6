# Issue 27's served goals on a CPU with AMX (BENCHMARKS.md section 33): the default model (packed Q4_1 GGUF,
# dtype auto = bfloat16 here) beside vLLM CPU bf16 at 64 streams, and beside vLLM and llama.cpp at one stream,
# vLLM's client via ../shared/anchors/serve_compare.sh, back to back in one window. `NO_COPIES=1` adds the
# default model with PAGEDSERVE_NO_ONEDNN_PACK=1 (no bf16 copies: the packed kernels alone).
S=$(cd "$(dirname "$0")" && pwd)/../../shared/anchors/serve_compare.sh
grep -q amx_bf16 /proc/cpuinfo || echo "note: this CPU has no AMX; the figures do not speak to issue 27's goals"
run() { echo "== $1 conc $2 $(date +%T)"; CONC=$2 NPROMPTS=$3 bash "$S" | tail -1; }
SYSTEM=pagedserve run "pagedserve default" 64 64
SYSTEM=vllm run "vllm bf16" 64 64
[ -n "${NO_COPIES:-}" ] && PAGEDSERVE_NO_ONEDNN_PACK=1 SYSTEM=pagedserve run "pagedserve default, no bf16 copies" 64 64
SYSTEM=pagedserve run "pagedserve default" 1 8
SYSTEM=llamacpp run "llamacpp" 1 8
SYSTEM=vllm run "vllm bf16" 1 8
