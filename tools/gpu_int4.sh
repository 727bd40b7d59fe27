#!/usr/bin/env bash
# GPU host, after tools/gpu_host.sh: int4 (MatMulNBits) identity and tokens/s on the shipped trained model.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/ortgpu${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m ortspec convert models/qwen35-python-20m /tmp/q4 --quant int4 --dtype float16 --max-length 1024
python3 - <<'PY'
import ortspec, onnxruntime as ort
ort.set_default_logger_severity(3)
prompts = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):", "for i in range(10):"]
greedy = ortspec.Session("/tmp/q4", provider="cuda").generate(prompts, max_new_tokens=96)
for commit in ("select", "readvance"):
    same = [ortspec.Session("/tmp/q4", provider="cuda", num_speculative_tokens=k, commit=commit).generate(
        prompts, max_new_tokens=96) == greedy for k in (1, 2, 3, 4)]
    print(f"int4 {commit}: speculative == greedy for k=1..4: {same}")
PY
python3 -m ortspec bench /tmp/q4 --provider cuda --k 0,1,2,3,4 --batch 1,4,16 --max-new-tokens 128 --repeats 3 \
  --json "$OUT/bench_int4.json" 2>&1 | grep -v "No registered"
