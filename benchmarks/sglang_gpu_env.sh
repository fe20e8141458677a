#!/bin/bash
# Sourced by the benchmarks/sglang_*_gpu.sh scripts on the GPU machine, from the repository root:
# SGLang's payload unpacked into /tmp/sglsite (once per machine: a warm machine keeps /tmp), an
# entry-point record for kvstrata (what `pip install` would write) so that SGLang's load_plugins()
# finds the plugin in every process, and the environment every SGLang process needs.
# Needs REPO (the repository root) and PAYLOAD_DIR (payload.tar.xz, as ../shared/sglang-gpu/build_payload.sh
# writes it; only read when /tmp/sglsite is not there yet).
SITE=${SGL_SITE:-/tmp/sglsite}
PLUGIN_META=/tmp/kvstrata_plugin_meta

sgl_unpack_payload() {
  [ -f $SITE/.ok ] && return 0
  [ -f "$PAYLOAD_DIR/payload.tar.xz" ] || { echo "no $SITE and no $PAYLOAD_DIR/payload.tar.xz"; return 1; }
  rm -rf $SITE; mkdir -p $SITE
  tar -xJf "$PAYLOAD_DIR/payload.tar.xz" -C $SITE && touch $SITE/.ok
}

sgl_env() {
  sgl_unpack_payload || return 1
  local version
  version=$(python3 -c "import re,sys; print(re.search(r'__version__ = \"(.*)\"', open(sys.argv[1]).read())[1])" \
    "$REPO/kvstrata/__init__.py")
  mkdir -p "$PLUGIN_META/kvstrata-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: kvstrata\nVersion: %s\n' "$version" \
    > "$PLUGIN_META/kvstrata-$version.dist-info/METADATA"
  printf '[sglang.srt.plugins]\nkvstrata = kvstrata.integrations.sglang:register\n' \
    > "$PLUGIN_META/kvstrata-$version.dist-info/entry_points.txt"
  export PYTHONPATH=$SITE:$REPO:$PLUGIN_META
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  echo "payload: $(du -sh $SITE | cut -f1); kvstrata $version from $REPO"
}

# health PORT: 0 when the server on PORT answers /health with 200
health() {
  python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$1/health',timeout=3).status!=200)" \
    >/dev/null 2>&1
}

# stop_server PID: the server's whole process group, TERM then KILL
stop_server() {
  kill -TERM -- -"$1" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$1" 2>/dev/null
}
