#!/usr/bin/env bash
# Session 16's GPU host calls (H200), each bounded, printing as it goes; results under $OUT.
#   OUT=$OUT bash benchmarks/session16/visit.sh a   setup; the batcher against generate, greedy and
#                                                  sampled (no HTTP); each serving layer with sampled
#                                                  requests (tools/serve_layers.py); the engine's
#                                                  profile under 16 sampled streaming clients (k = 0)
#   OUT=$OUT bash benchmarks/session16/visit.sh b   serve_bench sampled and greedy (k = 0, 2)
#   OUT=$OUT bash benchmarks/session16/visit.sh c   the CUDA checks (exactness, graph fallbacks)
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/ortgpu:/tmp/site:$PWD LD_LIBRARY_PATH=/usr/local/cuda/lib64 ORTSPEC_CUDA=1 PATH=/tmp/site/bin:$PATH
model=/tmp/visit_models/trained_fp16
convert() {
  [ -e "$model/manifest.json" ] || python3 -m ortspec convert models/qwen35-python-20m "$model" -k 4 --dtype float16 \
    --max-length 1024 --overwrite > /dev/null
}
case "$1" in
  a)
    bash tools/gpu_visit.sh setup || exit 1
    convert
    BATCHER_KS=0 bash tools/gpu_visit.sh batcher
    BATCHER_KS=0 BATCHER_TEMPERATURE=0.8 bash tools/gpu_visit.sh batcher
    echo "=== $(date +%T) serve_layers sampled k=0"
    timeout 200 python3 tools/serve_layers.py "$model" --provider cuda -k 0 --clients 1,16 --requests 4 --rounds 2 \
      --latency 0 --temperature 0.8 --top-p 0.95 --json "$OUT/layers_sampled_k0.json" 2>&1 | tee "$OUT/layers_sampled_k0.log"
    PROF=$OUT/prof_sampled TEMPERATURE=0.8 timeout 60 bash benchmarks/session14/engine_profile.sh "$model" 0 16 6 ;;
  b)
    convert
    SERVE_KS=0,2 SERVE_TEMPERATURE=0.8 SERVE_TOP_P=0.95 bash tools/gpu_visit.sh serve
    SERVE_KS=0,2 bash tools/gpu_visit.sh serve ;;
  c)
    bash tools/gpu_visit.sh check ;;
esac
