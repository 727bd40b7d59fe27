#!/usr/bin/env bash
# Session 18's GPU host calls (H200), each bounded, printing as it goes; results under $OUT.
#   OUT=$OUT bash benchmarks/session18/visit.sh a   setup; the CUDA batching checks (staggered joins: tokens and
#                                                  states) and spec_loop's, with a join queued behind two steps
#   OUT=$OUT bash benchmarks/session18/visit.sh b   the server of HEAD against probe/treeE (05725ab: a join behind
#                                                  one step), B_RUNS "k clients temperature" triples (;-separated)
#   OUT=$OUT bash benchmarks/session18/visit.sh c   py-spy on the engine process, k = 2, 16 clients
#   OUT=$OUT bash benchmarks/session18/visit.sh d   tools/gpu.py kernels, the trained model, k = 0, 3, batch 1, 16
#   OUT=$OUT bash benchmarks/session18/visit.sh g   the join's A/B again, longer: G_RUNS "k temperature" pairs, 16
#                                                  clients, 12 requests each, 8 rounds
#   OUT=$OUT bash benchmarks/session18/visit.sh e   the head's graphs of HEAD against probe/treeE's (05725ab): ortspec
#                                                  bench of each tree's conversion, alternating (E_ROUNDS, E_ARGS)
set -u
cd "$(dirname "$0")/../.."
source benchmarks/visit_lib.sh  # OUT, PYTHONPATH, models, trained, checks
case "$1" in
  a)
    checks ;;
  b)
    trained
    cp ortspec/_native*.so probe/treeE/ortspec/
    runs=("2 1,16 0" "0 16 0" "0 16 0.8")
    [ -n "${B_RUNS:-}" ] && IFS=';' read -ra runs <<< "$B_RUNS"
    for run in "${runs[@]}"; do
      set -- $run
      echo "=== $(date +%T) k=$1 clients $2 temperature $3: HEAD against 05725ab (a join behind one step)"
      timeout 200 python3 tools/serve_ab_throughput.py $models/trained_fp16 "$PWD" "$PWD/probe/treeE" -k $1 \
        --provider cuda --clients $2 --requests 4 --rounds ${B_ROUNDS:-3} --temperature $3 2>&1 | tee "$OUT/ab_join_k$1_c$2_t$3.log" | tail -6
    done ;;
  c)
    trained
    PROF=$OUT/prof timeout 120 bash benchmarks/session14/engine_profile.sh $models/trained_fp16 "2" "16" 6 2>&1 | tee "$OUT/engine_profile_k2_c16.log" | head -40 ;;
  d)
    timeout 280 python3 tools/gpu.py kernels --models trained -k 0,3 --batch 1,16 --top 25 --json "$OUT/kernels.json" 2>&1 | tail -80 ;;
  g)
    trained
    cp ortspec/_native*.so probe/treeE/ortspec/
    runs=("2 0" "0 0")
    [ -n "${G_RUNS:-}" ] && IFS=';' read -ra runs <<< "$G_RUNS"
    for run in "${runs[@]}"; do
      set -- $run
      echo "=== $(date +%T) k=$1 temperature $2, 16 clients: HEAD against 05725ab"
      timeout 200 python3 tools/serve_ab_throughput.py $models/trained_fp16 "$PWD" "$PWD/probe/treeE" -k $1 --provider cuda \
        --clients 16 --requests 12 --rounds 8 --temperature $2 2>&1 | tee "$OUT/ab_join_k$1_t$2_r8.log" | tail -3
    done ;;
  e)
    trained
    cp ortspec/_native*.so probe/treeE/ortspec/
    [ -e $models/treeE/manifest.json ] || (cd probe/treeE && PYTHONPATH=$PWD:/tmp/ortgpu:/tmp/site python3 -m ortspec convert \
      "$OLDPWD/models/qwen35-python-20m" $models/treeE -k 4 --dtype float16 --max-length 1024 --overwrite > /dev/null)
    args=${E_ARGS:-"--provider cuda -k 0,2,3 --batch 1,16 --max-new-tokens 128 --repeats 2 --prompts benchmarks/heldout_prompts.json"}
    for r in $(seq ${E_ROUNDS:-2}); do
      for side in treeE trained_fp16; do
        echo "=== $(date +%T) round $r: $side"
        timeout 150 python3 -m ortspec bench $models/$side $args --json "$OUT/head_${side}_r$r.json" 2>&1 | tail -9
      done
    done ;;
esac
