#!/usr/bin/env bash
# One phase of a GPU host visit per call, idempotent, each bounded and printing as it goes:
#   bash tools/gpu_visit.sh setup     onnxruntime-gpu (.ortgpu: the xz tar's parts, or the wheel's,
#                                     in /tmp/ortgpu-parts), wheels in .whl/ (starlette, uvicorn for
#                                     the server), ortspec built with CUDA, the native tests
#   bash tools/gpu_visit.sh check     identity and states on CUDA: tools/gpu.py check --no-bench,
#                                     then greedy_loop / spec_loop / auto_loop without timing rounds
#   bash tools/gpu_visit.sh gdn       tools/gpu.py gdn_verify (the CUDA verify's GDN forms)
#   bash tools/gpu_visit.sh batching  tools/gpu.py batch --checks-only (staggered batcher, buckets, stages)
#   bash tools/gpu_visit.sh serve     tools/serve_bench.py on the trained model, fp16 (SERVE_ENGINES: process,thread)
#   bash tools/gpu_visit.sh guidellm  tools/guidellm_bench.py on the trained model, fp16: guidellm (wheels in
#                                     .whl-gl/, made from tools/guidellm_host_wheels.txt; into /tmp/glsite)
#                                     loading `ortspec serve`, a concurrency sweep and a constant rate per k
#                                     (needs setup's .whl: starlette, uvicorn)
#   bash tools/gpu_visit.sh batcher   tools/batcher_bench.py: the batcher against generate, no HTTP
#   bash tools/gpu_visit.sh bench     ortspec bench, held-out prompts, trained model fp16, k 0..3 and auto
#   bash tools/gpu_visit.sh agree     tools/gpu.py agree: LARGE and the Qwen3.5-0.8B shape at p = 0.8
#   bash tools/gpu_visit.sh sample    sampling against greedy: tools/sampling_cost.py on CUDA, trained model
#   bash tools/gpu_visit.sh sample_dist   tools/gpu.py sample_dist (distributions on CUDA)
#   bash tools/gpu_visit.sh sample_cost   tools/gpu.py sample_cost (per step, trained and V = 248,320)
#   bash tools/gpu_visit.sh transform tools/sampling_transform_cost.py on CUDA (a token's choice alone)
#   bash tools/gpu_visit.sh ops       the same, the sampling graphs' ops one by one (--ops)
# Several phases in one call: bash tools/gpu_visit.sh setup check gdn. Results under $OUT (default /tmp/out).
# Smaller phases: BENCH_KS, BENCH_BATCHES, BENCH_REPEATS, SAMPLE_BATCHES, SAMPLE_TOP_PS, SAMPLE_KS, SAMPLE_ROUNDS,
# SAMPLE_DIST_SAMPLES, SAMPLE_DIST_S,
# SAMPLE_DIST_PARTS, SAMPLE_DIST_CONFIGS,
# AGREE_KS, AGREE_BUDGET, AGREE_Q08B= (empty: skip), GL_KS, GL_CONCURRENCY, GL_SECONDS,
# SERVE_TEMPERATURE, SERVE_TOP_P (sampled requests through serve), BATCHER_KS, BATCHER_BATCHES, BATCHER_TIMING,
# BATCHER_TEMPERATURE (sampled, top-p 0.95).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=/tmp/ortgpu:/tmp/site:$PWD LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1 ORTSPEC_CUDA=1
models=/tmp/visit_models
status=0

stamp() { echo "=== $(date +%T) $*"; }

run() {  # run SECONDS NAME COMMAND...: bounded, output teed to $out/NAME.log
  local seconds=$1 name=$2
  shift 2
  stamp "$name (at most ${seconds}s): $*"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log" || { echo "!!! $name failed or timed out"; status=1; }
}

setup() {
  if [ -e /tmp/ortgpu-parts/xz.00 ]; then bash .ortgpu/install_xz.sh; else bash .ortgpu/install.sh; fi || exit 1
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  stamp build
  python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
  python3 -c "import ortspec._native as n, onnxruntime as o; print(n.build_info()); print(o.__version__, o.get_available_providers())"
  stamp native tests
  cmake -S csrc -B build/native -DCMAKE_BUILD_TYPE=Release > /dev/null && cmake --build build/native -j 16 > /dev/null
  ctest --test-dir build/native --output-on-failure 2>&1 | tail -8
}

trained() {  # the trained model converted once per visit (fp16, max_length 1024)
  [ -e "$models/trained_fp16/manifest.json" ] || python3 -m ortspec convert models/qwen35-python-20m \
    "$models/trained_fp16" -k 4 --dtype float16 --max-length 1024 --overwrite > /dev/null
  echo "$models/trained_fp16"
}

guidellm_install() {  # guidellm 0.8.1 and what the image lacks of its needs, once per visit; its wrapper last
  if [ ! -x /tmp/glsite/guidellm-run ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/glsite \
      .whl-gl/*.whl || return 1
    printf '%s\n' '#!/usr/bin/env bash' 'PYTHONPATH=/tmp/glsite${PYTHONPATH:+:$PYTHONPATH} exec python3 -m guidellm "$@"' \
      > /tmp/glsite/guidellm-run.new && chmod +x /tmp/glsite/guidellm-run.new || return 1
    /tmp/glsite/guidellm-run.new --help > /dev/null || return 1
    mv /tmp/glsite/guidellm-run.new /tmp/glsite/guidellm-run
  fi
  /tmp/glsite/guidellm-run --version
}

for phase in "$@"; do
  case "$phase" in
    setup) setup ;;
    check)
      run 300 check python3 tools/gpu.py check --no-bench --json "$out/check.json"
      run 150 greedy_loop python3 tools/gpu.py greedy_loop --rounds 0 --json "$out/greedy_loop.json"
      run 200 spec_loop python3 tools/gpu.py spec_loop --rounds 0 --json "$out/spec_loop.json"
      run 200 auto_loop python3 tools/gpu.py auto_loop --rounds 0 --json "$out/auto_loop.json" ;;
    batching) run 240 batching python3 tools/gpu.py batch --checks-only --json "$out/batching.json" ;;
    gdn) run 330 gdn_verify python3 tools/gpu.py gdn_verify --budget-s 280 --json "$out/gdn_verify.json" ;;
    serve)
      model=$(trained)
      run 420 serve_bench python3 tools/serve_bench.py "$model" -k "${SERVE_KS:-0,2,auto}" --provider cuda \
        --clients "${SERVE_CLIENTS:-1,16}" --requests 4 --max-tokens 128 --rounds "${SERVE_ROUNDS:-2}" \
        --engines "${SERVE_ENGINES:-process}" --temperature "${SERVE_TEMPERATURE:-0}" --top-p "${SERVE_TOP_P:-1}" \
        --json "$out/serve_bench${SERVE_TEMPERATURE:+_sampled}.json" ;;
    guidellm)
      model=$(trained)
      if guidellm_install; then
        run 420 guidellm python3 tools/guidellm_bench.py "$model" -k "${GL_KS:-0,2}" --provider cuda \
          --concurrency "${GL_CONCURRENCY:-1,16}" --max-seconds "${GL_SECONDS:-15}" --max-batch-size 16 --threads 0 \
          --guidellm /tmp/glsite/guidellm-run --json "$out/guidellm.json"
      else
        echo "!!! guidellm: the install from .whl-gl failed"; status=1
      fi ;;
    batcher)
      model=$(trained)
      for k in ${BATCHER_KS:-0 2}; do
        run 150 "batcher_k$k${BATCHER_TEMPERATURE:+_sampled}" python3 tools/batcher_bench.py "$model" --provider cuda -k $k \
          --batch ${BATCHER_BATCHES:-1,16} --requests 4 --rounds 2 ${BATCHER_TIMING:+--timing} \
          ${BATCHER_TEMPERATURE:+--temperature $BATCHER_TEMPERATURE --top-p 0.95}
      done ;;
    bench)
      model=$(trained)
      run 360 bench python3 -m ortspec bench "$model" --provider cuda -k "${BENCH_KS:-0,1,2,3,auto}" --batch "${BENCH_BATCHES:-1,4,16}" \
        --max-new-tokens 128 --repeats "${BENCH_REPEATS:-3}" --prompts benchmarks/heldout_prompts.json \
        --json "$out/bench_heldout.json" ;;
    agree)
      run 240 agree_large python3 tools/gpu.py agree --ks "${AGREE_KS:-1,2,3,4}" --rounds 2 --budget-s "${AGREE_BUDGET:-200}" \
        --json "$out/agree_large.json"
      [ -n "${AGREE_Q08B-1}" ] && run 300 agree_q08b python3 tools/gpu.py agree --preset qwen35-0.8b --ks 2,3 --rounds 2 --budget-s 240 \
        --json "$out/agree_q08b.json" ;;
    sample)
      model=$(trained)
      for top_p in ${SAMPLE_TOP_PS:-0.95}; do  # 1.0: no row truncates, the tempered graphs
        for batch in ${SAMPLE_BATCHES:-1 16}; do
          run 150 "sample_b${batch}_p$top_p" python3 tools/sampling_cost.py "$model" --provider cuda -k "${SAMPLE_KS:-0,2,3}" \
            --batch $batch --new-tokens 128 --rounds "${SAMPLE_ROUNDS:-3}" --top-p $top_p
        done
      done ;;
    sample_dist)
      run "${SAMPLE_DIST_S:-330}" sample_dist python3 tools/gpu.py sample_dist --samples "${SAMPLE_DIST_SAMPLES:-20000}" \
        --parts "${SAMPLE_DIST_PARTS:-acceptance,greedy,model,planted}" --configs "${SAMPLE_DIST_CONFIGS:-0,1,2,3,4}" \
        --json "$out/sample_dist.json" ;;
    sample_cost) run 240 sample_cost python3 tools/gpu.py sample_cost --rounds 2 --json "$out/sample_cost.json" ;;
    sampling_ops) run 120 sampling_ops python3 tools/gpu.py sampling_ops --json "$out/sampling_ops.json" ;;
    transform)
      run 120 transform_4096 python3 tools/sampling_transform_cost.py --provider cuda --vocab 4096 --batch 1,16,64 \
        --configs "temperature,top_p 0.95" --repeats 20
      run 150 transform_248320 python3 tools/sampling_transform_cost.py --provider cuda --vocab 248320 --batch 1,16 \
        --configs "temperature,top_p 0.95" --repeats 5 ;;
    ops)
      for vocab in 4096 248320; do
        run 120 "ops_$vocab" python3 tools/sampling_transform_cost.py --provider cuda --ops --vocab $vocab --batch 1,16 \
          --configs temperature --repeats 10
      done ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
done
stamp done
exit $status
