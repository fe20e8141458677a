#!/bin/bash
# SGLang 0.5.17 with and without the kvstrata plugin on one GPU: serve the Llama-3-8B-shaped
# random-weight model and benchmark each config with SGLang's bench_serving (the workload of
# ../shared/sglang-gpu/README.md: 1,536 in / 512 out tokens, 256 prompts, max concurrency 256).
# Adapted from ../shared/sglang-gpu/device_run.sh (its payload, model dir and logic); what it adds:
# kvstrata on PYTHONPATH with an entry-point record so SGLang's load_plugins() finds the plugin in
# every process, per-config environment (KVSTRATA_*), a cap on each bench, and a result table.
#
#   PAYLOAD_DIR=/path/to/.sgl bash benchmarks/sglang_plugin_gpu.sh [CONFIG ...]     (from the repo root)
#   CONFIG = name:attention_backend:kv_cache_dtype[:extra,server,flags[:ENV=VALUE,ENV=VALUE]]
#   attention_backend "@kvstrata" serves with `kvstrata serve` (kvstrata's own engine; kv_cache_dtype
#   is its history codec) instead of SGLang. (That path and BENCH_TOOL=kvstrata have not run on a GPU yet.)
#
# (PAYLOAD_DIR, not SGL_DIR: SGLang reads SGL_DIR as its deprecated name of SGLANG_DIR.)
# PAYLOAD_DIR holds payload.tar.xz (once per machine), model/ and bin/envcheck.py, as written by
# ../shared/sglang-gpu/build_payload.sh. Knobs: DEADLINE (s, 470), NPROMPTS (256), CONC (256), ILEN
# (1536), OLEN (512), MIN_LEFT (s needed to start a config, 100), BENCH_CAP (s, 170),
# BENCH_TOOL (sglang: SGLang's bench_serving; kvstrata: `kvstrata bench`, the same workload), ENVCHECK (1),
# SGL_GRAPH_BS (SGLang's --cuda-graph-max-bs, 256: its own default on an H200), PROFILE_STEPS (0: off;
# else once a config's server logs a decode batch of all CONC requests, SGLang's /start_profile records
# that many steps' GPU kernels and `sglang_trace_table.py` adds their kernel table to summary.txt).
# Writes to $OUT: summary.txt (the table last), env.txt, bench.log, bench.jsonl, server_<name>.log.
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-470}
NPROMPTS=${NPROMPTS:-256}; CONC=${CONC:-256}; ILEN=${ILEN:-1536}; OLEN=${OLEN:-512}
MIN_LEFT=${MIN_LEFT:-100}; BENCH_CAP=${BENCH_CAP:-170}; BENCH_TOOL=${BENCH_TOOL:-sglang}
OUT=${OUT:-/tmp/sgl_out}; mkdir -p "$OUT"
REPO=$(pwd)
PAYLOAD_DIR=${PAYLOAD_DIR:-$REPO/.sgl}
MODEL=$PAYLOAD_DIR/model
PORT=30000
TABLE=/tmp/sglang_plugin_table.md
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

# 1. SGLang's payload (once per machine), the plugin's entry point and the environment
source "$REPO/benchmarks/sglang_gpu_env.sh"
sgl_env > /tmp/sgl_env.txt 2>&1 || { cat /tmp/sgl_env.txt; exit 1; }
log "$(cat /tmp/sgl_env.txt)"

# 2. environment, CUDA-path imports, and plugin discovery as SGLang does it (ENVCHECK=0: skipped; on a
# fresh machine its imports took 68 s of a call)
if [ "${ENVCHECK:-1}" = 1 ]; then
{
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  python3 "$PAYLOAD_DIR/bin/envcheck.py"
  python3 -c "from sglang.srt.plugins import load_plugins; load_plugins()
from sglang.srt.mem_cache.registry import registered_radix_cache_backends as r
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS as a
print('plugin: radix backends', r(), 'kvstrata attention', 'kvstrata' in a)"
} > "$OUT/env.txt" 2>&1
log "envcheck: $(grep -c '^OK' "$OUT/env.txt") OK, $(grep -c '^FAIL' "$OUT/env.txt") FAIL; $(grep '^plugin:' "$OUT/env.txt")"
fi

# Once the server's log shows a decode batch of all CONC requests, SGLang's profiler records the next
# PROFILE_STEPS steps' GPU kernels into $OUT/prof_<name>/ (a background job of bench()).
profile_decode() {
  local name=$1 slog=$2 dir="$OUT/prof_$1"
  while ! grep -q "Decode batch.*#running-req: $CONC," "$slog" 2>/dev/null; do sleep 0.5; done
  python3 -c "import json, sys, urllib.request as u
body = json.dumps({'output_dir': sys.argv[1], 'num_steps': int(sys.argv[2]), 'activities': ['GPU']}).encode()
r = u.Request('http://127.0.0.1:$PORT/start_profile', body, {'Content-Type': 'application/json'})
print(u.urlopen(r, timeout=30).read().decode().strip())" "$dir" "$PROFILE_STEPS" >> "$OUT/bench.log" 2>&1
}

profile_table() {
  local name=$1 trace
  trace=$(ls "$OUT/prof_$name"/*.trace.json.gz 2>/dev/null | head -1)
  if [ -z "$trace" ]; then log "$name: no profile trace"; return; fi
  # the trace is tens of MB: kept only when it could not be read
  python3 "$REPO/benchmarks/sglang_trace_table.py" "$trace" --title "$name" >> "$OUT/summary.txt" 2>&1 \
      && rm -f "$trace"
}

bench() {
  local name=$1 tokens=$2 prof_pid=""
  if [ "${PROFILE_STEPS:-0}" -gt 0 ]; then
    profile_decode "$name" "$OUT/server_$name.log" &
    prof_pid=$!
  fi
  echo "===== $name backend=$backend kv=$kvd extra='$extra' env='$envs' nprompts=$NPROMPTS conc=$CONC" >> "$OUT/bench.log"
  local tb=$(date +%s) tl=$(( $(left) - 25 ))
  [ $tl -gt "$BENCH_CAP" ] && tl=$BENCH_CAP
  [ $tl -lt 10 ] && tl=10
  local before=0
  [ -f "$OUT/bench.jsonl" ] && before=$(wc -l < "$OUT/bench.jsonl")
  local workload=(--random-input-len $ILEN --random-output-len $OLEN --random-range-ratio 1.0
      --num-prompts $NPROMPTS --max-concurrency $CONC --seed 1 --warmup-requests 1 --dataset-name random-ids)
  if [ "$BENCH_TOOL" = kvstrata ]; then
    timeout $tl python3 -m kvstrata bench --base-url http://127.0.0.1:$PORT --tokenizer "$MODEL" \
        "${workload[@]}" --disable-tqdm --output-file "$OUT/bench.jsonl" >> "$OUT/bench.log" 2>&1
  else
    timeout $tl python3 -m sglang.bench_serving --backend sglang --host 127.0.0.1 --port $PORT \
        --model "$MODEL" --tokenizer "$MODEL" --tokenize-prompt "${workload[@]}" \
        --output-file "$OUT/bench.jsonl" >> "$OUT/bench.log" 2>&1
  fi
  local rc=$?
  log "$name: bench ($BENCH_TOOL) rc=$rc in $(( $(date +%s) - tb ))s"
  if [ -n "$prof_pid" ]; then
    kill "$prof_pid" 2>/dev/null
    sleep 5  # the trace is written when the profiled steps end
    profile_table "$name"
  fi
  if [ -f "$OUT/bench.jsonl" ] && [ "$(wc -l < "$OUT/bench.jsonl")" -gt "$before" ]; then
    tail -1 "$OUT/bench.jsonl" | python3 -c "import json,sys; r=json.load(sys.stdin); print(
      f\"| $name | {r['completed']} | {r['output_throughput']:,.0f} | {r['total_throughput']:,.0f} |\"
      f\" {r['median_ttft_ms']:,.0f} | {r['median_itl_ms']:.1f} | $tokens |\")" >> "$TABLE"
  else
    echo "| $name | bench failed (rc=$rc) | | | | | $tokens |" >> "$TABLE"
  fi
}

run_cfg() {
  local name=$1 backend=$2 kvd=$3 extra=${4:-} envs=${5:-}
  extra=${extra//,/ }
  if [ "$(left)" -lt "$MIN_LEFT" ]; then log "$name: SKIPPED, only $(left)s left"; return; fi
  local slog="$OUT/server_$name.log"
  log "$name: launching backend=$backend kv=$kvd extra='$extra' env='$envs'"
  # shellcheck disable=SC2086
  if [ "$backend" = @kvstrata ]; then
    env ${envs//,/ } setsid python3 -m kvstrata serve --model "$MODEL" --load-format dummy \
        --host 127.0.0.1 --port $PORT --kv-cache-dtype "$kvd" $extra > "$slog" 2>&1 &
  else
    env ${envs//,/ } setsid python3 -m sglang.launch_server --model-path "$MODEL" --load-format dummy \
        --host 127.0.0.1 --port $PORT --attention-backend "$backend" --kv-cache-dtype "$kvd" \
        --cuda-graph-max-bs "${SGL_GRAPH_BS:-256}" $extra > "$slog" 2>&1 &
  fi
  local pid=$! ts=$(date +%s) ok=0
  while [ "$(left)" -gt 40 ]; do
    kill -0 $pid 2>/dev/null || break
    if health $PORT; then ok=1; break; fi
    sleep 2
  done
  local tokens
  tokens=$(grep -o 'max_total_num_tokens=[0-9]*' "$slog" | head -1 | cut -d= -f2)
  # kvstrata serve logs its memory plan as a table: "cold pool | x GiB | N tokens (P pages)"
  [ -z "$tokens" ] && tokens=$(grep 'cold pool' "$slog" | grep -oE '[0-9,]+ tokens' | head -1 | tr -d ', tokens')
  log "$name: server ready=$ok after $(( $(date +%s) - ts ))s; max_total_num_tokens=${tokens:-?}"
  if [ $ok = 1 ]; then
    bench "$name" "${tokens:-?}"
  else
    echo "| $name | server failed | | | | | ${tokens:-?} |" >> "$TABLE"
    log "$name: server not ready; tail: $(grep -v '^\s*$' "$slog" | tail -12 | tr '\n' '|' | cut -c1-1500)"
  fi
  stop_server $pid
  sleep 2
  log "$name: stopped; gpu mem used now $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
}

echo "| config | completed | output tok/s | total tok/s | median TTFT ms | median ITL ms | max_total_num_tokens |" > "$TABLE"
echo "|---|---:|---:|---:|---:|---:|---:|" >> "$TABLE"
for c in "$@"; do
  IFS=: read -r n b k x e <<< "$c"
  run_cfg "$n" "$b" "$k" "${x:-}" "${e:-}"
done
log "done; $(left)s left of DEADLINE"
cat "$TABLE" | tee -a "$OUT/summary.txt"
