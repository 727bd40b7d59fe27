#!/usr/bin/env bash
# Session 19's GPU host calls (H200), each bounded, printing as it goes; results under $OUT.
#   OUT=$OUT bash benchmarks/session19/visit.sh a   setup; the CUDA batching checks (staggered joins: tokens and
#                                                  states) and spec_loop's, with the prefill Run not waiting
#   OUT=$OUT bash benchmarks/session19/visit.sh b   the server of HEAD against probe/treeA (6c10be9) and, where
#                                                  B_TREES names them, other probe trees: B_RUNS "k clients
#                                                  temperature" triples (;-separated). First run (331ba22):
#                                                  treeA and treeC (331ba22 + ff59fe2, a join behind two steps);
#                                                  second (cf72c3e, prefills on their own thread): treeA
#   OUT=$OUT bash benchmarks/session19/visit.sh p   benchmarks/session19/prefill_launch.py: a prefill Run's host time
#   OUT=$OUT bash benchmarks/session19/visit.sh s   tools/serve_bench.py: the server against generate, k = 0, 2
set -u
cd "$(dirname "$0")/../.."
source benchmarks/visit_lib.sh  # OUT, PYTHONPATH, models, trained, checks
case "$1" in
  a)
    checks ;;
  b)
    trained
    for tree in probe/tree*; do cp ortspec/_native*.so $tree/ortspec/; done
    runs=("2 16,1 0" "0 16,1 0" "2 16 0.8")
    [ -n "${B_RUNS:-}" ] && IFS=';' read -ra runs <<< "$B_RUNS"
    for run in "${runs[@]}"; do
      set -- $run
      echo "=== $(date +%T) k=$1 clients $2 temperature $3: HEAD against ${B_TREES:-treeA}"
      trees=$(for t in ${B_TREES:-treeA}; do echo -n " $PWD/probe/$t"; done)
      timeout ${B_SECONDS:-200} python3 tools/serve_ab_throughput.py $models/trained_fp16 "$PWD" $trees -k $1 --provider cuda --clients $2 --requests ${B_REQUESTS:-8} --rounds ${B_ROUNDS:-4} \
        --temperature $3 2>&1 | tee "$OUT/ab_k$1_c${2/,/_}_t$3.log" | tail -8
    done ;;
  p)
    trained
    timeout 120 python3 benchmarks/session19/prefill_launch.py $models/trained_fp16 2>&1 | tee "$OUT/prefill_launch.log" ;;
  s)
    trained
    timeout ${S_SECONDS:-280} python3 tools/serve_bench.py $models/trained_fp16 -k ${S_KS:-0,2} --provider cuda \
      --clients 1,16 --requests 4 --max-tokens 128 --rounds ${S_ROUNDS:-2} --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log" | tail -14 ;;
esac
