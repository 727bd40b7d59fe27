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
source benchmarks/visit_lib.sh  # OUT, PYTHONPATH, models, trained, checks, serve_bench, serve_ab
case "$1" in
  a)
    checks ;;
  b)
    serve_ab "2 16,1 0;0 16,1 0;2 16 0.8" ;;
  p)
    trained
    timeout 120 python3 benchmarks/session19/prefill_launch.py $models/trained_fp16 2>&1 | tee "$OUT/prefill_launch.log" ;;
  s)
    serve_bench ;;
esac
