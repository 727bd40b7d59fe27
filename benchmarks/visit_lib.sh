# Sourced by benchmarks/session*/visit.sh from the project root: the GPU host's environment, the
# trained model converted once per visit (fp16, max_length 1024), the checks a visit runs first, and
# the server's two benchmarks (serve_bench, serve_ab).
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
serve_bench() {  # tools/serve_bench.py, the server against generate (S_KS, S_CLIENTS, S_ROUNDS, S_ARGS, S_NAME, S_SECONDS)
  trained
  timeout ${S_SECONDS:-280} python3 tools/serve_bench.py $models/trained_fp16 -k ${S_KS:-0,2} --provider cuda \
    --clients ${S_CLIENTS:-1,16} --requests 4 --max-tokens 128 --rounds ${S_ROUNDS:-2} ${S_ARGS:-} \
    --json "$OUT/serve${S_NAME:-}.json" 2>&1 | tee "$OUT/serve${S_NAME:-}.log" | tail -14
}
serve_ab() {  # serve_ab RUNS: tools/serve_ab_throughput.py, HEAD's server against probe/ trees (B_TREES, default
  # treeA), B_RUNS (else RUNS): ";"-separated "k clients temperature" triples (B_REQUESTS, B_ROUNDS, B_SECONDS)
  trained
  for tree in probe/tree*; do cp ortspec/_native*.so $tree/ortspec/; done
  local runs run trees
  IFS=';' read -ra runs <<< "${B_RUNS:-$1}"
  trees=$(for t in ${B_TREES:-treeA}; do echo -n " $PWD/probe/$t"; done)
  for run in "${runs[@]}"; do
    set -- $run
    echo "=== $(date +%T) k=$1 clients $2 temperature $3: HEAD against ${B_TREES:-treeA}"
    timeout ${B_SECONDS:-200} python3 tools/serve_ab_throughput.py $models/trained_fp16 "$PWD" $trees -k $1 --provider cuda \
      --clients $2 --requests ${B_REQUESTS:-8} --rounds ${B_ROUNDS:-4} --temperature $3 2>&1 \
      | tee "$OUT/ab_k$1_c${2/,/_}_t$3.log" | tail -8
  done
}
