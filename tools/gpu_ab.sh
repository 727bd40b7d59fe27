#!/usr/bin/env bash
# GPU host, after tools/gpu_host.sh: A/B of two ortspec Python packages on one native build and
# one model, in alternating rounds (machine noise hits both alike). The other side is an older
# package exported beside the tree:
#   git archive OLD_COMMIT ortspec | tar -x -C .ab_old        (here; .ab_old is carried)
#   bash tools/gpu_ab.sh MODEL_DIR                              (there)
# Writes $OUT/ab.json and prints tokens/s per (k, batch) for both sides with new/old ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp ortspec/_native*.so .ab_old/ortspec/
model=$(realpath "$1")
DEFAULT_ARGS="--provider cuda --k 0,1,2,3,4 --batch 1,4,16 --max-new-tokens 128 --repeats 2"  # AB_ARGS overrides
cd /tmp  # so that `python3 -m` does not put the tree's own package first
for round in 1 2; do
  for side in old new; do
    path=$([ $side = old ] && echo "$root/.ab_old" || echo "$root")
    PYTHONPATH=$path:/tmp/ortgpu python3 -c "import ortspec; print('$side:', ortspec.__file__)"
    PYTHONPATH=$path:/tmp/ortgpu python3 -m ortspec bench "$model" ${AB_ARGS:-$DEFAULT_ARGS} \
      --json "$OUT/ab_${side}_${round}.json" > /dev/null 2>&1
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {side: [json.loads((out / f"ab_{side}_{r}.json").read_text()) for r in (1, 2)] for side in ("old", "new")}
def tps(side):
    table = {}
    for run in runs[side]:
        for row in run["rows"]:
            table.setdefault((row["k"], row["batch"]), []).append(row)
    return {key: (statistics.mean(r["tokens_per_second"] for r in rows),
                  statistics.mean(r["mean_tokens_per_step"] for r in rows)) for key, rows in table.items()}
old, new = tps("old"), tps("new")
print("| k | batch | old tokens/s | new tokens/s | new/old | old MTP/bound | new MTP/bound |")
print("|---|---|---|---|---|---|---|")
for (k, b) in sorted(old):
    o, n = old[(k, b)], new[(k, b)]
    bound = lambda side, t: "-" if k == 0 else f"{t[0] / (t[1] * side[(0, b)][0]):.2f}"
    print(f"| {k} | {b} | {o[0]:.0f} | {n[0]:.0f} | {n[0] / o[0]:.2f} | {bound(old, o)} | {bound(new, n)} |")
(out / "ab.json").write_text(json.dumps({"old": {str(k): v for k, v in old.items()},
                                          "new": {str(k): v for k, v in new.items()}}, indent=1))
PY
rm -f "$OUT"/ab_old_*.json "$OUT"/ab_new_*.json
