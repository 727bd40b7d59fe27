#!/usr/bin/env bash
# Where the engine process's time goes under load (H200): `ortspec serve` on CUDA (max batch 16),
# C streaming clients (tools/serve_load.py, 128-token requests), py-spy on the engine process and
# on the HTTP process for SECONDS once the load runs; per k and client count, the engine thread's
# samples by stack (spy_aggregate.py) and the load's tok/s over the same stretch.
#   PROF=DIR [TEMPERATURE=0.8] bash benchmarks/session14/engine_profile.sh MODEL "0 2" "1 16" [SECONDS]
# (TEMPERATURE: sampled requests, top-p 0.95, each seeded: sampled_load.py)
set -u
model=$1; ks=$2; clients=$3; secs=${4:-6}; out=${PROF:-/tmp/prof}; mkdir -p "$out"; here=$(dirname "$0")
for k in $ks; do
  port=$((8200 + k))
  python3 -m ortspec serve "$model" -k "$k" --provider cuda --max-batch-size 16 --port $port > "$out/serve_k$k.log" 2>&1 &
  srv=$!
  until curl -sf "localhost:$port/health" > /dev/null; do sleep 0.5; kill -0 $srv 2> /dev/null || break; done
  child=$(pgrep -P $srv -f spawn_main)
  for c in $clients; do
    if [ -n "${TEMPERATURE:-}" ]; then  # sampled requests
      python3 "$here/sampled_load.py" "http://127.0.0.1:$port" "$c" "$TEMPERATURE" > /dev/null 2>&1 &
    else
      python3 tools/serve_load.py --url "http://127.0.0.1:$port" --clients "$c" --requests 100000 --max-tokens 128 \
        --stream yes > /dev/null 2>&1 &
    fi
    load=$!
    sleep 2
    before=$(curl -s "localhost:$port/metrics" | grep -E '^ortspec_generated_tokens_total' | awk '{print $2}')
    py-spy record -p "$child" -d "$secs" -r 200 -f raw -o "$out/spy_engine_k${k}_c$c.txt" --threads --idle --nonblocking > /dev/null 2>&1 &
    spy=$!
    py-spy record -p "$srv" -d "$secs" -r 200 -f raw -o "$out/spy_http_k${k}_c$c.txt" --threads --idle --nonblocking > /dev/null 2>&1
    wait $spy
    after=$(curl -s "localhost:$port/metrics" | grep -E '^ortspec_generated_tokens_total' | awk '{print $2}')
    kill $load; wait $load 2> /dev/null
    echo "=== k=$k clients=$c: tokens over the profile ~ $before -> $after"
    python3 "$here/spy_aggregate.py" "$out/spy_engine_k${k}_c$c.txt" --depth 4 --top 22
    python3 "$here/spy_aggregate.py" "$out/spy_http_k${k}_c$c.txt" --thread MainThread --below Runner.run --depth 3 --top 8
  done
  kill $srv; wait $srv 2> /dev/null
done
