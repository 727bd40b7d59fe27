#!/usr/bin/env bash
# One visit to the GPU host: install the staged onnxruntime-gpu, build ortspec with CUDA,
# run the native CUDA tests, then each GPU tool named in GPU_TOOL (default gpu_check; "none"
# runs none), each with GPU_TOOL_ARGS. WAIT_FOR=FILE waits (up to 15 min, while a
# train_tiny.py runs) for FILE before the tools, e.g. for a training run started in the
# background to finish before anything is timed. Output goes to stdout and $OUT (if set).
#   (the .ortgpu parts must already be in /tmp/ortgpu-parts; see README "GPU users")
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ortgpu/install.sh
export PYTHONPATH=/tmp/ortgpu${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1
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
for tool in ${GPU_TOOL:-gpu_check}; do
  [ "$tool" = none ] && continue
  python3 tools/$tool.py --json "${OUT:-/tmp}/$tool.json" ${GPU_TOOL_ARGS:-} 2>&1 | tee "${OUT:-/tmp}/$tool.log" || status=1
done
exit $status
