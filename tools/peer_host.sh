#!/usr/bin/env bash
# GPU host: ortspec beside onnxruntime-genai (tools/peer_bench.py) on models/qwen35-python-20m and
# on LARGE (the 1B random model of tools/gpu.py scale, generated here), tables printed last.
# Before: tools/gpu_host.sh has installed onnxruntime-gpu in /tmp/ortgpu and built ortspec
# (GPU_TOOL=none), and .peer/ was carried: the onnxruntime-genai-cuda 0.18.0 and onnx-ir wheels for
# CPython 3.12 (pip download --only-binary=:all:, 17 MB; docs/benchmarks.md).
#   bash tools/peer_host.sh        # results in $OUT: peer_20m.json/.log, peer_large.json/.log
# Bounded: everything stops by DEADLINE_S (default 440 s; expected about 6 minutes on an H200).
# Each harness run is killed at the time left minus what the next one needs. A run that dies
# (a peer configuration crashing the process, say) or exits 3 (an ortspec configuration failed,
# as after a sticky CUDA error) is retried once without the peer's CUDA graphs, reusing its
# exports; the first attempt's JSON is kept as peer_NAME.first.json. Every run rewrites its
# JSON after each round, so a run cut short still reports what it measured; the tables at the
# end are printed from the JSON. PEER_BENCH_EXTRA adds arguments to every run (a dry run of
# this script's control flow on a CPU machine: PEER_BENCH_EXTRA="--provider cpu ...").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/ortgpu:/tmp/og${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-440}
if ! ls .peer/onnxruntime_genai_cuda-*.whl > /dev/null 2>&1; then
  echo "no .peer/onnxruntime_genai_cuda-*.whl: download the peer's wheels into .peer/ and carry it (docs/benchmarks.md)"; exit 1
fi
python3 -m pip install -q --upgrade --no-deps --no-index --target /tmp/og .peer/*.whl 2>&1 | grep -v WARNING
python3 -c "import onnxruntime_genai as g, onnxruntime as o
print('onnxruntime-genai', g.__version__, '| onnxruntime', o.__version__, o.get_available_providers())" || exit 1

# attempt NAME LIMIT_S ARGS...: one tools/peer_bench.py run, killed after LIMIT_S; its exit status.
attempt() {
  local name=$1 limit=$2; shift 2
  echo "== $name: $* (up to ${limit} s)"
  timeout -k 5 "$limit" python3 tools/peer_bench.py "$@" ${PEER_BENCH_EXTRA:-} --json "$OUT/peer_$name.json" 2>&1 \
    | grep --line-buffered -v "No registered" >> "$OUT/peer_$name.log"
  local rc=${PIPESTATUS[0]}
  tail -3 "$OUT/peer_$name.log"
  return "$rc"
}

# bench NAME RESERVE_S ARGS...: attempt with the time left minus RESERVE_S (what later runs need);
# on failure, once more without the peer's CUDA graphs if at least a minute is left.
bench() {
  local name=$1 reserve=$2; shift 2
  local limit=$((DEADLINE_S - SECONDS - reserve))
  : > "$OUT/peer_$name.log"
  [ "$limit" -lt 30 ] && { echo "== $name: skipped, ${limit} s left"; return; }
  attempt "$name" "$limit" "$@" && return
  local rc=$?
  echo "== $name exited with status $rc"
  [ "$rc" -eq 2 ] && return  # refused options: a retry would be refused the same way
  limit=$((DEADLINE_S - SECONDS - reserve))
  [ "$limit" -lt 60 ] && { echo "== $name: no time left to retry"; return; }
  [ -f "$OUT/peer_$name.json" ] && mv "$OUT/peer_$name.json" "$OUT/peer_$name.first.json"
  attempt "$name" "$limit" "$@" --no-graph --reuse-exports
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
bench 20m 250 models/qwen35-python-20m --work /tmp/peer_20m --rounds 3 --budget-s 100
bench large 0 --large --work /tmp/peer_large --k 2 --mtp 2 --prompts-per-set 4 --rounds 3 --budget-s 45
for name in 20m large; do
  echo
  [ -f "$OUT/peer_$name.json" ] && python3 tools/peer_bench.py --report "$OUT/peer_$name.json" \
    || echo "peer_$name: no result (see $OUT/peer_$name.log)"
done
echo "total ${SECONDS} s"
