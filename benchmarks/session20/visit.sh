#!/usr/bin/env bash
# Session 20's GPU host calls (H200), each bounded, printing as it goes; results under $OUT.
#   OUT=$OUT bash benchmarks/session20/visit.sh a   setup; the CUDA batching checks (staggered joins: tokens and
#                                                  states, prefills apart) and spec_loop's
#   OUT=$OUT bash benchmarks/session20/visit.sh p   py-spy (probe/py-spy) on the server's engine process at 1 client
#                                                  (benchmarks/session14/engine_profile.sh) and on generate at
#                                                  batch 1 (gen_loop.py), k = 0 and 2: where each side's host goes
#   OUT=$OUT bash benchmarks/session20/visit.sh s   tools/serve_bench.py: the server against generate, k = 0, 2
#                                                  (S_ARGS: more of its arguments, e.g. --ignore-eos; S_NAME: a suffix)
#   OUT=$OUT bash benchmarks/session20/visit.sh b   tools/serve_ab_throughput.py: the server of HEAD against
#                                                  probe/treeA, B_RUNS "k clients temperature" triples
set -u
cd "$(dirname "$0")/../.."
source benchmarks/visit_lib.sh  # OUT, PYTHONPATH, models, trained, checks, serve_bench, serve_ab
case "$1" in
  a)
    checks ;;
  p)
    trained
    mkdir -p /tmp/site/bin && cp probe/py-spy /tmp/site/bin/ && chmod +x /tmp/site/bin/py-spy
    PROF=/tmp/prof timeout 150 bash benchmarks/session14/engine_profile.sh $models/trained_fp16 "${P_KS:-0 2}" "${P_CLIENTS:-1}" 6 \
      2>&1 | tee "$OUT/engine_profile.log"
    for k in ${P_KS:-0 2}; do
      python3 benchmarks/session20/gen_loop.py $models/trained_fp16 $k 1 12 > /tmp/prof/gen_k$k.log 2>&1 &
      gen=$!
      sleep 5
      py-spy record -p $gen -d 6 -r 200 -f raw -o /tmp/prof/spy_gen_k$k.txt --threads --idle --nonblocking > /dev/null 2>&1
      wait $gen
      echo "=== generate k=$k batch 1: $(tail -1 /tmp/prof/gen_k$k.log)"
      python3 benchmarks/session14/spy_aggregate.py /tmp/prof/spy_gen_k$k.txt --thread MainThread --below Session.generate \
        --depth 4 --top 24
    done 2>&1 | tee "$OUT/generate_profile.log"
    tar czf "$OUT/spy.tgz" -C /tmp/prof . ;;
  s)
    serve_bench ;;
  b)
    serve_ab "0 1,16 0;2 1,16 0" ;;
esac
