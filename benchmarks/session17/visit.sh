#!/usr/bin/env bash
# Session 17's GPU host calls (H200), each bounded, printing as it goes; results under $OUT.
#   OUT=$OUT bash benchmarks/session17/visit.sh a   setup; tools/gpu.py check on the committed graphs (the
#                                                  prefill's last row, sample_logits)
#   OUT=$OUT bash benchmarks/session17/visit.sh b   the loops' checks (greedy, speculative, auto; no timing)
#   OUT=$OUT bash benchmarks/session17/visit.sh c   (setup on a fresh machine) spec_loop's checks again (the
#                                                  end-state check by the rows of each end's step); serve_bench
#                                                  greedy k = 0, 2 with the step split (rows, step cost, busy share)
#   OUT=$OUT bash benchmarks/session17/visit.sh e   serve_bench sampled k = 0, 2 with the step split
#   OUT=$OUT bash benchmarks/session17/visit.sh f   (setup) the server of HEAD against probe/treeD (dc657f8: before
#                                                  the rows read as Python ints and UniformStream), greedy and
#                                                  sampled k = 0 and greedy k = 2 (F_RUNS: other "k clients
#                                                  temperature" triples, ;-separated; F_ROUNDS: rounds, default 4)
#   OUT=$OUT bash benchmarks/session17/visit.sh d   the servers of older trees
#                                                  side by side (probe/treeB: 7b17ea3, before the prefill's
#                                                  last row; probe/treeC: 91919c8, before sample_logits),
#                                                  each serving a model its own converter made
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/ortgpu:/tmp/site:$PWD LD_LIBRARY_PATH=/usr/local/cuda/lib64 ORTSPEC_CUDA=1 PATH=/tmp/site/bin:$PATH
models=/tmp/visit_models
convert() {  # convert TREE DIR: the trained model, fp16, by TREE's converter
  [ -e "$2/manifest.json" ] || (cd "$1" && PYTHONPATH=$PWD:/tmp/ortgpu:/tmp/site python3 -m ortspec convert \
    "$OLDPWD/models/qwen35-python-20m" "$2" -k 4 --dtype float16 --max-length 1024 --overwrite > /dev/null)
}
case "$1" in
  a)
    bash tools/gpu_visit.sh setup || exit 1
    convert . $models/trained_fp16
    echo "=== $(date +%T) check"
    timeout 300 python3 tools/gpu.py check --no-bench --json "$OUT/check.json" 2>&1 | tail -40 ;;
  b)
    bash tools/gpu_visit.sh check 2>&1 | grep -v "^round" | tail -60 ;;
  c)
    python3 -c "import onnxruntime" 2> /dev/null || bash tools/gpu_visit.sh setup || exit 1
    convert . $models/trained_fp16
    echo "=== $(date +%T) spec_loop"
    timeout 200 python3 tools/gpu.py spec_loop --rounds 0 --json "$OUT/spec_loop.json" 2>&1 | grep -v "pipelined == plain: True"
    SERVE_KS=0,2 bash tools/gpu_visit.sh serve ;;
  d)
    for tree in treeB treeC; do
      cp ortspec/_native*.so probe/$tree/ortspec/ && convert probe/$tree $models/$tree
    done
    echo "=== $(date +%T) greedy: HEAD against 7b17ea3"
    timeout 200 python3 tools/serve_ab_throughput.py $models/trained_fp16 "$PWD" "$PWD/probe/treeB@$models/treeB" -k 0 \
      --provider cuda --clients 1,16 --requests 4 --rounds 4 2>&1 | tee "$OUT/ab_prefill_row.log" | tail -8
    echo "=== $(date +%T) sampled: HEAD against 91919c8"
    timeout 200 python3 tools/serve_ab_throughput.py $models/trained_fp16 "$PWD" "$PWD/probe/treeC@$models/treeC" -k 0 \
      --provider cuda --clients 1,16 --requests 4 --rounds 4 --temperature 0.8 2>&1 | tee "$OUT/ab_sample_logits.log" | tail -8 ;;
  f)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
    convert . $models/trained_fp16
    cp ortspec/_native*.so probe/treeD/ortspec/
    runs=("0 1,16 0" "0 1,16 0.8" "2 16 0")
    [ -n "${F_RUNS:-}" ] && IFS=';' read -ra runs <<< "$F_RUNS"
    for run in "${runs[@]}"; do
      set -- $run
      echo "=== $(date +%T) k=$1 clients $2 temperature $3: HEAD against dc657f8 (before the host-side step changes)"
      timeout 150 python3 tools/serve_ab_throughput.py $models/trained_fp16 "$PWD" "$PWD/probe/treeD" -k $1 \
        --provider cuda --clients $2 --requests 4 --rounds ${F_ROUNDS:-4} --temperature $3 2>&1 | tee "$OUT/ab_host_k$1_c$2_t$3.log" | tail -6
    done ;;
  e)
    SERVE_KS=0,2 SERVE_TEMPERATURE=0.8 SERVE_TOP_P=0.95 bash tools/gpu_visit.sh serve ;;
esac
