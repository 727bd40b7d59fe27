#!/usr/bin/env bash
# One visit to the GPU host. Contract (what the lead relies on):
#   1. installs the staged onnxruntime-gpu (.ortgpu/install.sh; the parts must already be in
#      /tmp/ortgpu-parts, see docs/gpu.md) and puts it on PYTHONPATH (/tmp/ortgpu);
#   2. builds ortspec with CUDA in place (pip install -e .: a GPU is present, so setup.py compiles
#      the CUDA kernels) and prints both build infos;
#   3. builds and runs the native tests (ctest: arena, graph_slots, state kernels CPU and CUDA);
#   4. WAIT_FOR=FILE: waits up to 15 minutes for FILE while a train_tiny.py runs (e.g. a
#      training started in the background must finish before anything is timed);
#   5. runs `python3 tools/gpu.py SUBCOMMAND --json $OUT/gpu_SUBCOMMAND.json ARGS` for each
#      SUBCOMMAND in GPU_TOOL (default: check; "none" runs none), output teed to
#      $OUT/gpu_SUBCOMMAND.log. ARGS = $GPU_TOOL_ARGS (every subcommand) then $GPU_ARGS_<name>
#      (that one only, e.g. GPU_ARGS_ab=/tmp/trained_fp16). The former script names still
#      work (GPU_TOOL=gpu_check, gpu_batch_check, gpu_pipeline, gpu_scale, gpu_host_profile).
# Exit status 1 if a subcommand failed. Output goes to stdout and $OUT (default /tmp).
#   GPU_TOOL="check pipeline" bash tools/gpu_host.sh
#   GPU_TOOL=check GPU_TOOL_ARGS=--no-bench bash tools/gpu_host.sh
#   GPU_TOOL="trained ab" GPU_ARGS_ab=/tmp/trained_fp16 bash tools/gpu_host.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ortgpu/install.sh
export PYTHONPATH=/tmp/ortgpu${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
python3 -c "import ortspec._native as n, onnxruntime as o; print(n.build_info()); print(o.__version__, o.get_available_providers())"
cmake -S csrc -B build/native -DCMAKE_BUILD_TYPE=Release > /dev/null && cmake --build build/native -j 16 > /dev/null
ctest --test-dir build/native --output-on-failure 2>&1 | tail -6
./build/native/ortspec_native_tests state_kernels_cuda 2>&1 | grep -i "copy_buffer" || true
if [ -n "${WAIT_FOR:-}" ]; then
  for _ in $(seq 180); do [ -e "$WAIT_FOR" ] && break; pgrep -f train_tiny.py > /dev/null || break; sleep 5; done
  echo "waited for $WAIT_FOR: $([ -e "$WAIT_FOR" ] && echo present || echo MISSING)"
fi
status=0
for tool in ${GPU_TOOL:-check}; do
  [ "$tool" = none ] && continue
  case "$tool" in  # the former script names
    gpu_batch_check) tool=batch ;;
    gpu_host_profile) tool=profile ;;
    gpu_*) tool=${tool#gpu_} ;;
  esac
  per_tool="GPU_ARGS_$tool"
  # shellcheck disable=SC2086  # the ARGS are word-split on purpose
  python3 tools/gpu.py "$tool" --json "$out/gpu_$tool.json" ${GPU_TOOL_ARGS:-} ${!per_tool:-} 2>&1 \
    | tee "$out/gpu_$tool.log" || status=1
done
exit $status
