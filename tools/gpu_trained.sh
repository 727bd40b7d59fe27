#!/usr/bin/env bash
# GPU host: train the small model (tools/train_tiny.py), convert it, check speculative == greedy
# on CUDA, and benchmark it side by side with transformers. Run after tools/gpu_host.sh has
# installed onnxruntime-gpu and built ortspec (GPU_TOOL=none skips its check script).
#   MINUTES=7 TRAIN_ARGS="--site-packages --max-corpus-mb 200" bash tools/gpu_trained.sh
# (results and the packed checkpoint land in $OUT). A finished run already in /tmp/trained
# (train_log.json present, e.g. trained in the background during an earlier call) is used as is.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/ortgpu${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -f /tmp/trained/train_log.json ]; then
  tail -45 /tmp/train.log 2>/dev/null || true
else
  python3 tools/train_tiny.py /tmp/trained --minutes "${MINUTES:-7}" --device cuda ${TRAIN_ARGS:-} 2>&1 | tail -45
fi
python3 -m ortspec convert /tmp/trained /tmp/trained_fp32 --max-length 1024
python3 -m ortspec convert /tmp/trained /tmp/trained_fp16 --max-length 1024 --dtype float16
python3 - <<'PY'
import ortspec, onnxruntime as ort
ort.set_default_logger_severity(3)
prompts = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):", "for i in range(10):"]
for model in ("/tmp/trained_fp32", "/tmp/trained_fp16"):
    greedy = ortspec.Session(model, provider="cuda").generate(prompts, max_new_tokens=96)
    for commit in ("select", "readvance"):
        same = [ortspec.Session(model, provider="cuda", num_speculative_tokens=k, commit=commit).generate(
            prompts, max_new_tokens=96) == greedy for k in (1, 2, 3, 4)]
        print(f"{model} {commit}: speculative == greedy for k=1..4: {same}")
print("sample (fp16, k=3):", repr(ortspec.Session("/tmp/trained_fp16", provider="cuda", num_speculative_tokens=3).generate(prompts[0], max_new_tokens=80)))
PY
python3 -m ortspec bench /tmp/trained_fp16 --provider cuda --k 0,1,2,3,4 --batch 1,4,16 --max-new-tokens 128 \
  --repeats 3 --transformers /tmp/trained --json "$OUT/bench_trained_fp16.json" --plot "$OUT/bench_trained_fp16.png" 2>&1 | grep -v "No registered"
cp /tmp/trained/eval.json "$OUT/" 2>/dev/null || true
tar czf /tmp/trained.tgz -C /tmp trained && split -b 15M -d /tmp/trained.tgz "$OUT/trained.tgz.part"
ls -la "$OUT"
