#!/bin/bash
# Greedy output of the default model (SmolLM2-135M-Instruct, real weights) through SGLang 0.5.17 on
# one GPU, with and without the kvstrata plugin: every CONFIG is served at once (the model is small;
# each server has its own port and a capped pool), the prompts go to all of them, and
# benchmarks/sglang_greedy.py prints token-for-token agreement with the first CONFIG (the baseline).
#
# The model is not on the GPU machine and a device call carries at most 64 MiB, so it travels in
# parts, one call each, made here by `python benchmarks/sglang_greedy.py stage STAGE`
# (STAGE/p1/part1, ..., STAGE/meta), and joined in /tmp (a warm machine keeps it between calls):
#   bash benchmarks/sglang_greedy_gpu.sh part STAGE/pN                  (every part but the last)
#   bash benchmarks/sglang_greedy_gpu.sh run STAGE/pN STAGE/meta CONFIG...   (the last part, then the run)
# Both unpack SGLang's payload into /tmp/sglsite when it is not there (PAYLOAD_DIR/payload.tar.xz).
#   CONFIG = name:attention_backend:kv_cache_dtype[:extra,server,flags[:ENV=VALUE,ENV=VALUE]]
# Knobs: DEADLINE (s, 300: on a fresh machine the servers needed over 145 s to answer, Triton
# compiling), NEW_TOKENS (64), DTYPE (bfloat16: SGLang's --dtype for every server; float32 would
# give float32 logits, where greedy identity does not hinge on BF16 ties, but SGLang 0.5.17 cannot
# serve a float32 model on CUDA: sgl_kernel's rmsnorm has no float32, and every server, SGLang's own
# triton baseline included, dies in its decode-graph capture; see docs/sglang.md).
# Writes to $OUT: summary.txt (the table last), build.log, results.json, server_<name>.log.
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-300}; NEW_TOKENS=${NEW_TOKENS:-64}; DTYPE=${DTYPE:-bfloat16}
OUT=${OUT:-/tmp/sgl_out}; mkdir -p "$OUT"
REPO=$(pwd)
PAYLOAD_DIR=${PAYLOAD_DIR:-$REPO/.sgl}
WORK=/tmp/kvs_greedy
MODEL=$WORK/model
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

source "$REPO/benchmarks/sglang_gpu_env.sh"
sgl_env > /tmp/sgl_env.txt 2>&1; rc=$?
log "$(cat /tmp/sgl_env.txt)"
mode=$1; parts=$2; shift 2
mkdir -p $WORK/parts && cp "$parts"/part* $WORK/parts/
log "parts in $WORK/parts: $(ls -l $WORK/parts | awk 'NR>1{print $NF":"$5}' | tr '\n' ' ')"
if [ "$mode" = part ]; then
  # compile SGLang's modules to .pyc in /tmp/sglsite while the next part travels (runs on after this call)
  [ $rc = 0 ] && setsid nohup python3 -c "import sglang.launch_server, sglang.srt.managers.scheduler" \
    > /tmp/kvs_greedy/warm_imports.log 2>&1 < /dev/null &
  exit $rc
fi
[ $rc = 0 ] || exit 1
meta=$1; shift

# 1. the model: joined, checked against kvstrata's converted model, written as an HF directory
PYTHONPATH=$PYTHONPATH:$meta timeout 120 python3 benchmarks/sglang_greedy.py build $WORK/parts "$meta" $MODEL \
  > "$OUT/build.log" 2>&1 || { log "build failed: $(tail -5 "$OUT/build.log" | tr '\n' '|')"; exit 1; }
log "$(tail -1 "$OUT/build.log")"

# 2. every config at once, each on its own port with a capped pool
COMMON="--model-path $MODEL --dtype $DTYPE --skip-tokenizer-init --host 127.0.0.1 --page-size 16
  --max-running-requests 16 --max-total-tokens 32768 --mem-fraction-static 0.85 --cuda-graph-max-bs 8
  --disable-prefill-cuda-graph"
declare -a NAMES PIDS PORTS
port=30001
for c in "$@"; do
  IFS=: read -r name backend kvd extra envs <<< "$c"
  extra=${extra:-}; envs=${envs:-}
  # shellcheck disable=SC2086
  env ${envs//,/ } setsid python3 -m sglang.launch_server $COMMON --port $port --attention-backend "$backend" \
    --kv-cache-dtype "$kvd" ${extra//,/ } > "$OUT/server_$name.log" 2>&1 &
  NAMES+=("$name"); PIDS+=($!); PORTS+=($port)
  log "$name: launched on port $port: backend=$backend kv=$kvd extra='${extra//,/ }' env='${envs//,/ }'"
  port=$((port + 1))
done
declare -A READY=()
settled=0
while [ "$(left)" -gt 45 ] && [ $settled -lt ${#NAMES[@]} ]; do
  for i in "${!NAMES[@]}"; do
    n=${NAMES[$i]}
    [ -n "${READY[$n]:-}" ] && continue
    if health "${PORTS[$i]}"; then READY[$n]=1; settled=$((settled + 1)); log "$n: ready"
    elif ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      READY[$n]=0; settled=$((settled + 1))
      log "$n: died: $(grep -v '^\s*$' "$OUT/server_$n.log" | tail -8 | tr '\n' '|' | cut -c1-1200)"
    fi
  done
  sleep 2
done

# 3. the prompts to every ready server; agreement with the baseline
servers=()
for i in "${!NAMES[@]}"; do
  n=${NAMES[$i]}
  tokens=$(grep -o 'max_total_num_tokens=[0-9]*' "$OUT/server_$n.log" | head -1 | cut -d= -f2)
  log "$n: ready=${READY[$n]:-timeout}; max_total_num_tokens=${tokens:-?}"
  [ "${READY[$n]:-}" = 1 ] && servers+=("$n=${PORTS[$i]}")
done
if [ "${READY[${NAMES[0]}]:-}" = 1 ]; then
  timeout $(( $(left) - 15 )) python3 benchmarks/sglang_greedy.py compare "$meta/prompts.json" "${servers[@]}" \
    --new-tokens "$NEW_TOKENS" --out "$OUT/results.json" > /tmp/greedy_table.md 2>&1
else
  echo "baseline ${NAMES[0]} not ready: nothing compared" > /tmp/greedy_table.md
fi
log "compare rc=$?"
for i in "${!NAMES[@]}"; do
  log "${NAMES[$i]}: decode batches in CUDA graphs: $(grep -c 'cuda graph: True' "$OUT/server_${NAMES[$i]}.log"), eager: $(grep -c 'cuda graph: False' "$OUT/server_${NAMES[$i]}.log")"
  stop_server "${PIDS[$i]}" &
done
wait
log "done; $(left)s left of DEADLINE"
cat /tmp/greedy_table.md | tee -a "$OUT/summary.txt"
