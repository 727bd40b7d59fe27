# Sourced by benchmarks/session*/visit.sh from the project root: the GPU host's environment, the
# trained model converted once per visit (fp16, max_length 1024), and the checks a visit runs first.
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/ortgpu:/tmp/site:$PWD LD_LIBRARY_PATH=/usr/local/cuda/lib64 ORTSPEC_CUDA=1 PATH=/tmp/site/bin:$PATH
models=/tmp/visit_models
trained() {
  [ -e $models/trained_fp16/manifest.json ] || python3 -m ortspec convert models/qwen35-python-20m $models/trained_fp16 \
    -k 4 --dtype float16 --max-length 1024 --overwrite > /dev/null
}
checks() {  # setup where needed; the CUDA batching checks (staggered joins: tokens and states) and spec_loop's
  python3 -c "import onnxruntime" 2> /dev/null || bash tools/gpu_visit.sh setup || exit 1
  trained
  echo "=== $(date +%T) batching checks"
  timeout 240 python3 tools/gpu.py batch --checks-only --json "$OUT/batching.json" 2>&1 | tail -25
  echo "=== $(date +%T) spec_loop"
  timeout 200 python3 tools/gpu.py spec_loop --rounds 0 --json "$OUT/spec_loop.json" 2>&1 | grep -v "pipelined == plain: True" | tail -25
}
