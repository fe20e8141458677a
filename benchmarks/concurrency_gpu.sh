#!/bin/bash
# Issue 12's 1,024-concurrency goal on one GPU: `kvstrata serve` with fp4_e2m1 history, then SGLang 0.5.17
# with BF16 KV (its triton attention backend), one after the other, the same workload: Llama-3-8B
# geometry, random weights, 1,536 in / 512 out tokens, 1,024 prompts at max concurrency 1,024.
#
#   PAYLOAD_DIR=/path/to/.sgl bash benchmarks/concurrency_gpu.sh          (repo root, on the GPU machine)
#
# kvstrata: benchmarks/serve_bench_gpu.sh (`kvstrata bench`, step timeline TRACE=1) with KVS_CONFIGS
# (default fp4:fp4_e2m1:--mem-fraction-static,0.9: SGLang's own default fraction on an H200 is about
# 0.906, see the README section "1,024 concurrent requests"). SGLang: benchmarks/sglang_plugin_gpu.sh
# (SGLang's bench_serving) with SGL_CONFIGS (default sgl_bf16:triton:auto). Knobs: NPROMPTS, CONC (1024),
# DEADLINE (s for all, 520), KVS_DEADLINE (s for kvstrata's stage, 300; SGLang gets what is left),
# STAGES ("kvstrata sglang": which stages run, in that order).
# PAYLOAD_DIR holds payload.tar.xz (read once per machine), model/ and bin/; WHL_DIR (../.whl) the
# httptools/uvloop cp312 wheels. Writes to $OUT: summary.txt (both tables last) and logs.tgz.
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-520}; KVS_DEADLINE=${KVS_DEADLINE:-300}
export NPROMPTS=${NPROMPTS:-1024} CONC=${CONC:-1024}
REAL_OUT=${OUT:-/tmp/conc_out}; LOGS=/tmp/conc_logs
rm -rf "$LOGS"; mkdir -p "$LOGS" "$REAL_OUT"
PAYLOAD_DIR=$(cd "${PAYLOAD_DIR:-../.sgl}" && pwd); export PAYLOAD_DIR
WHL_DIR=${WHL_DIR:-../.whl}
SUM=$LOGS/summary.txt
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUM"; }
save() { cp "$SUM" "$REAL_OUT/summary.txt"; tar -C "$LOGS" -czf "$REAL_OUT/logs.tgz" . 2>/dev/null; }

[ -f /tmp/sglsite/.ok ] || { mkdir -p /tmp/sglsite && tar -xJf "$PAYLOAD_DIR/payload.tar.xz" -C /tmp/sglsite \
  && touch /tmp/sglsite/.ok; }
SITE=/tmp/sglsite
if ls "$WHL_DIR"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/whlsite "$WHL_DIR"/*.whl \
    && SITE=$SITE:/tmp/whlsite
fi
log "setup done; site $SITE; $(nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader)"

run_kvstrata() {
  local limit=$(( KVS_DEADLINE < $(left) ? KVS_DEADLINE : $(left) ))
  MODEL=$PAYLOAD_DIR/model SITE=$SITE TRACE=1 DEADLINE=$limit MIN_LEFT=120 OUT=$LOGS/kvstrata \
    bash benchmarks/serve_bench_gpu.sh ${KVS_CONFIGS:-fp4:fp4_e2m1:--mem-fraction-static,0.9} > "$LOGS/kvstrata.log" 2>&1
  log "kvstrata stage done"; cat "$LOGS/kvstrata/summary.txt" >> "$SUM" 2>/dev/null
}

run_sglang() {
  log "SGLang stage: $(left)s left"
  ENVCHECK=0 DEADLINE=$(left) MIN_LEFT=120 BENCH_CAP=$(( $(left) - 50 )) OUT=$LOGS/sglang \
    bash benchmarks/sglang_plugin_gpu.sh ${SGL_CONFIGS:-sgl_bf16:triton:auto} > "$LOGS/sglang.log" 2>&1
  log "SGLang stage done"
  grep -h -m1 -oE 'mem_fraction_static=[0-9.]+' "$LOGS"/sglang/server_*.log >> "$SUM" 2>/dev/null
  grep -h -E 'Decode batch' "$LOGS"/sglang/server_*.log | awk 'NR % 25 == 1' | cut -c1-220 | tail -12 >> "$SUM"
  cat "$LOGS/sglang/summary.txt" >> "$SUM" 2>/dev/null
}

for stage in ${STAGES:-kvstrata sglang}; do
  "run_$stage"; save
done
echo "kvstrata:" >> "$SUM"; cat "$LOGS/kvstrata/table.md" >> "$SUM" 2>/dev/null
save; cat "$SUM"
