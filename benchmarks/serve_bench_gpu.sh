#!/bin/bash
# `kvstrata serve --load-format dummy` + `kvstrata bench` on one GPU: the workload of the SGLang anchors
# in ../shared/sglang-gpu/README.md (Llama-3-8B geometry, random weights, 1,536 in / 512 out tokens,
# 256 prompts, max concurrency 256), one server per history codec, one after the other.
#
#   MODEL=/path/to/model_dir SITE=/path/to/site bash benchmarks/serve_bench_gpu.sh CONFIG ...   (repo root)
#   CONFIG = name:kv_cache_dtype[:extra,server,flags]
#
# MODEL: a directory with config.json (+ tokenizer files), e.g. ../shared/sglang-gpu's model/. SITE:
# a directory put first on PYTHONPATH holding what the GPU image lacks (fastapi, starlette, uvicorn,
# pydantic, opentelemetry-api: the SGLang payload's site; httptools and a recent uvloop from their cp312 wheels,
# several directories joined with ':'; the server logs `uvloop + httptools` when it runs on them). Knobs: NPROMPTS (256), CONC (256), ILEN (1536), OLEN (512), DEADLINE (s, 280),
# MIN_LEFT (s needed to start a config, 60), BENCH_TOOLS (kvstrata: `kvstrata bench`; sglang: SGLang's
# bench_serving as an OpenAI client; kvstrata@N: `kvstrata bench` with N client processes; comma-separated:
# each in turn against the same server, seeds 1, 2, ...),
# BENCH_WORKERS (kvstrata bench --num-workers, 4). Every server runs with --max-running-requests $CONC
# --cuda-graph-max-bs $CONC --chunked-prefill-size ${CHUNK:-8192} --kv-plan off.
# TRACE=1: each server writes its step timeline (KVSTRATA_STEP_TRACE, kvstrata/engine/trace.py) to
# trace_<name>.jsonl, summarized by benchmarks/step_timeline.py into timeline_<name>.txt and summary.txt.
# Writes to $OUT: summary.txt (the table last), bench.jsonl (`kvstrata bench`'s JSON lines),
# bench_<name>.log, server_<name>.log.
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-280}; MIN_LEFT=${MIN_LEFT:-60}
BENCH_TOOLS=${BENCH_TOOLS:-kvstrata}; BENCH_WORKERS=${BENCH_WORKERS:-4}; NPROMPTS=${NPROMPTS:-256}; CONC=${CONC:-256}; ILEN=${ILEN:-1536}; OLEN=${OLEN:-512}; CHUNK=${CHUNK:-8192}
OUT=${OUT:-/tmp/serve_bench_out}; mkdir -p "$OUT"
PORT=${PORT:-30000}
TABLE=$OUT/table.md
export PYTHONPATH=${SITE:+$SITE:}$(pwd) PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }
health() {
  python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$PORT/health',timeout=3).status!=200)" \
    >/dev/null 2>&1
}

# bench_one NAME TOOL SEED TOKENS: one benchmark of the running server, a row of the table.
# TOOL kvstrata: `kvstrata bench` (token-id prompts); sglang: SGLang's bench_serving (needs sglang on
# PYTHONPATH, e.g. the payload's site) as an OpenAI client (`--backend vllm`: /v1/completions, text prompts).
bench_one() {
  local name=$1 tool=$2 seed=$3 tokens=$4 workers=$BENCH_WORKERS
  if [[ $tool == kvstrata@* ]]; then workers=${tool#kvstrata@}; workers=${workers:-$BENCH_WORKERS}; fi  # kvstrata@N
  local tb=$(date +%s) tl=$(( $(left) - 10 )) before=0 rc
  [ -f "$OUT/bench.jsonl" ] && before=$(wc -l < "$OUT/bench.jsonl")
  if [ "$tool" = sglang ]; then
    local served
    served=$(python3 -c "import json,urllib.request; print(json.load(urllib.request.urlopen(
      'http://127.0.0.1:$PORT/v1/models', timeout=10))['data'][0]['id'])")
    timeout $tl python3 -m sglang.bench_serving --backend vllm --host 127.0.0.1 --port $PORT \
        --model "$MODEL" --served-model-name "$served" --tokenizer "$MODEL" --dataset-name random-ids --random-input-len "$ILEN" \
        --random-output-len "$OLEN" --random-range-ratio 1.0 --num-prompts "$NPROMPTS" \
        --max-concurrency "$CONC" --seed "$seed" --warmup-requests 1 --disable-tqdm \
        --output-file "$OUT/bench.jsonl" > "$OUT/bench_${name}_$tool.log" 2>&1
  else
    timeout $tl python3 -m kvstrata bench --base-url http://127.0.0.1:$PORT --tokenizer "$MODEL" \
        --dataset-name random-ids --random-input-len "$ILEN" --random-output-len "$OLEN" \
        --random-range-ratio 1.0 --num-prompts "$NPROMPTS" --max-concurrency "$CONC" --seed "$seed" \
        --warmup-requests 1 --num-workers "$workers" --disable-tqdm --output-file "$OUT/bench.jsonl" \
        > "$OUT/bench_${name}_$tool.log" 2>&1
  fi
  rc=$?
  log "$name: bench ($tool) rc=$rc in $(( $(date +%s) - tb ))s"
  if [ -f "$OUT/bench.jsonl" ] && [ "$(wc -l < "$OUT/bench.jsonl")" -gt "$before" ]; then
    tail -1 "$OUT/bench.jsonl" | python3 -c "import json,sys; r=json.load(sys.stdin); print(
      f\"| $name | $tool | {r['completed']} | {r.get('errors', '-')} | {r['duration']:.1f}\"
      f\" | {r['output_throughput']:,.0f} | {r['total_throughput']:,.0f} | {r['median_ttft_ms']:,.0f}\"
      f\" | {r['median_itl_ms']:.1f} | $tokens |\")" >> "$TABLE"
  else
    echo "| $name | $tool | bench failed (rc=$rc) | | | | | | | $tokens |" >> "$TABLE"
  fi
}

run_cfg() {
  local name=$1 kvd=$2 extra=${3:-}
  extra=${extra//,/ }
  if [ "$(left)" -lt "$MIN_LEFT" ]; then log "$name: SKIPPED, only $(left)s left"; return; fi
  local slog="$OUT/server_$name.log"
  log "$name: kvstrata serve --kv-cache-dtype $kvd $extra"
  local trace=""
  [ "${TRACE:-0}" = 1 ] && trace="$OUT/trace_$name.jsonl"
  # shellcheck disable=SC2086
  KVSTRATA_STEP_TRACE=$trace setsid python3 -m kvstrata serve --model "$MODEL" --load-format dummy --host 127.0.0.1 --port $PORT \
      --kv-cache-dtype "$kvd" --max-running-requests "$CONC" --cuda-graph-max-bs "$CONC" \
      --chunked-prefill-size "$CHUNK" --kv-plan off $extra > "$slog" 2>&1 &
  local pid=$! ts=$(date +%s) ok=0
  while [ "$(left)" -gt 20 ]; do
    kill -0 $pid 2>/dev/null || break
    if health; then ok=1; break; fi
    sleep 2
  done
  local tokens
  tokens=$(grep 'cold pool' "$slog" | grep -oE '[0-9,]+ tokens' | head -1 | tr -d ', tokens')
  log "$name: ready=$ok after $(( $(date +%s) - ts ))s; cold pool ${tokens:-?} tokens"
  if [ $ok = 1 ]; then
    local tool seed=1
    for tool in ${BENCH_TOOLS//,/ }; do
      bench_one "$name" "$tool" "$seed" "${tokens:-?}"
      seed=$(( seed + 1 ))  # other prompts, so a later tool does not hit the cache the earlier one left
    done
  else
    echo "| $name | - | server failed | | | | | | | ${tokens:-?} |" >> "$TABLE"
    log "$name: server not ready; tail: $(grep -v '^\s*$' "$slog" | tail -12 | tr '\n' '|' | cut -c1-1500)"
  fi
  grep -iE 'decode|throughput|captured' "$slog" | tail -3 >> "$OUT/summary.txt"
  kill -TERM -- -$pid 2>/dev/null
  for _ in $(seq 1 15); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$pid 2>/dev/null
  sleep 1
  if [ -n "$trace" ] && [ -s "$trace" ]; then
    python3 benchmarks/step_timeline.py "$trace" > "$OUT/timeline_$name.txt" 2>&1
    cat "$OUT/timeline_$name.txt" >> "$OUT/summary.txt"
  fi
}

echo "| config | bench | completed | errors | duration s | output tok/s | total tok/s | median TTFT ms | median ITL ms | cold pool tokens |" > "$TABLE"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" >> "$TABLE"
for c in "$@"; do
  IFS=: read -r n k x <<< "$c"
  run_cfg "$n" "$k" "${x:-}"
done
log "done; $(left)s left of DEADLINE"
tee -a "$OUT/summary.txt" < "$TABLE"
