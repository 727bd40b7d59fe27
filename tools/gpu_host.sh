#!/usr/bin/env bash
# One visit to the GPU host: install the staged onnxruntime-gpu, build ortspec with CUDA,
# run the native CUDA tests and tools/gpu_check.py. Output goes to stdout and $OUT (if set).
#   (the five .ortgpu parts must already be in /tmp/ortgpu-parts; see README "GPU users")
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
[ "${GPU_TOOL:-gpu_check}" = none ] || python3 tools/${GPU_TOOL:-gpu_check}.py --json "${OUT:-/tmp}/${GPU_TOOL:-gpu_check}.json" 2>&1 | tee "${OUT:-/tmp}/${GPU_TOOL:-gpu_check}.log"
