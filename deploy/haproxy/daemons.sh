#!/usr/bin/env bash
# N voiced daemons on one machine, one per GPU, behind HAProxy with this folder's haproxy.cfg; and their stop.
#
#   deploy/haproxy/daemons.sh start N [COMMAND ...]   daemon i (1..N) on GPU i-1 (CUDA_VISIBLE_DEVICES), listening
#                                                     on 127.0.0.i; then HAProxy in front; returns once every
#                                                     daemon's /readyz says it serves
#   deploy/haproxy/daemons.sh drain I                 SIGTERM daemon I alone: it drains (its calls finish, the
#                                                     balancer sends new ones to the others) and exits
#   deploy/haproxy/daemons.sh stop                    SIGTERM every daemon (each drains), then HAProxy, by PID
#
# COMMAND is `voiced serve` unless given; the script appends --listen and --http to it. To measure the
# daemons together with the end-to-end benchmark's callers (random full-size weights, forced lengths):
#
#   deploy/haproxy/daemons.sh start 2 voiced bench e2e --serve
#   voiced bench e2e --target 127.0.0.1:50051 --wav speech.wav --sessions 64 128 256 --out two.json
#   deploy/haproxy/daemons.sh stop
#
# The daemons share ports on 127.0.0.1, 127.0.0.2, ... (the loopback network); HAProxy takes the gRPC port
# callers dial. Environment (defaults in brackets): VOICED_RUN_DIR, PIDs and logs [./voiced-daemons];
# VOICED_GRPC_PORT and VOICED_HTTP_PORT, each daemon's [50061, 8081]; VOICED_LB_GRPC, the balancer's
# [0.0.0.0:50051]; VOICED_GPUS, how many GPUs the daemons take in turn [N]; HAPROXY, its binary [haproxy];
# VOICED_START_TIMEOUT and VOICED_STOP_TIMEOUT in seconds [1800, 120]. haproxy.cfg reads the rest.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${VOICED_RUN_DIR:-$PWD/voiced-daemons}"
export VOICED_GRPC_PORT="${VOICED_GRPC_PORT:-50061}" VOICED_HTTP_PORT="${VOICED_HTTP_PORT:-8081}"
HAPROXY="${HAPROXY:-haproxy}"

die() { echo "daemons.sh: $*" >&2; exit 1; }

ready() {  # ready HOST PORT: /readyz answers 200 (bash's /dev/tcp: the GPU machine may lack curl)
    local status
    exec 3<>"/dev/tcp/$1/$2" 2>/dev/null || return 1
    printf 'GET /readyz HTTP/1.0\r\nHost: %s\r\n\r\n' "$1" >&3
    read -r -t 5 _ status _ <&3 || status=""
    exec 3<&- 3>&-
    [ "$status" = 200 ]
}

config_for() {  # the shipped haproxy.cfg, with a server line per daemon past the two it names
    local n=$1
    if [ "$n" -le 2 ]; then echo "$HERE/haproxy.cfg"; return; fi
    awk -v n="$n" '{ print }
        / server voiced2 / { for (i = 3; i <= n; i++) { line = $0; gsub(/voiced2/, "voiced" i, line)
                             gsub(/VOICED_2-127\.0\.0\.2/, "VOICED_" i "-127.0.0." i, line); print line } }' \
        "$HERE/haproxy.cfg" > "$RUN_DIR/haproxy.cfg"
    echo "$RUN_DIR/haproxy.cfg"
}

stop_pid() {  # stop_pid FILE: SIGTERM the process it names, wait for it to exit, SIGKILL past the timeout
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 0
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        local deadline=$((SECONDS + ${VOICED_STOP_TIMEOUT:-120}))
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "daemons.sh: $(basename "$1" .pid) (pid $pid) still runs after SIGTERM; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$1"
}

start() {
    local n=${1:-}
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "start N [COMMAND ...]: N, the number of daemons, is missing"
    shift
    local cmd=("$@")
    [ ${#cmd[@]} -gt 0 ] || cmd=(voiced serve)
    command -v "$HAPROXY" >/dev/null || die "$HAPROXY is not installed (Debian: apt install haproxy, or set HAPROXY)"
    mkdir -p "$RUN_DIR"
    ls "$RUN_DIR"/*.pid >/dev/null 2>&1 && die "$RUN_DIR holds PIDs of a running set: stop it first"
    local gpus=${VOICED_GPUS:-$n}
    for i in $(seq 1 "$n"); do
        export "VOICED_$i=127.0.0.$i"
        CUDA_VISIBLE_DEVICES=$(((i - 1) % gpus)) "${cmd[@]}" --listen "127.0.0.$i:$VOICED_GRPC_PORT" \
            --http "127.0.0.$i:$VOICED_HTTP_PORT" > "$RUN_DIR/daemon$i.log" 2>&1 &
        echo $! > "$RUN_DIR/daemon$i.pid"
    done
    local cfg
    cfg=$(config_for "$n")
    "$HAPROXY" -c -q -f "$cfg" || die "haproxy refused $cfg"
    "$HAPROXY" -f "$cfg" > "$RUN_DIR/haproxy.log" 2>&1 &
    echo $! > "$RUN_DIR/haproxy.pid"
    local deadline=$((SECONDS + ${VOICED_START_TIMEOUT:-1800}))
    for i in $(seq 1 "$n"); do
        until ready "127.0.0.$i" "$VOICED_HTTP_PORT"; do
            kill -0 "$(cat "$RUN_DIR/daemon$i.pid")" 2>/dev/null || die "daemon $i exited; see $RUN_DIR/daemon$i.log"
            [ $SECONDS -lt $deadline ] || die "daemon $i not serving after ${VOICED_START_TIMEOUT:-1800} s"
            sleep 1
        done
    done
    echo "daemons.sh: $n daemons serving behind HAProxy on ${VOICED_LB_GRPC:-0.0.0.0:50051} (PIDs, logs: $RUN_DIR)"
}

case "${1:-}" in
    start) shift; start "$@" ;;
    drain) [ -f "$RUN_DIR/daemon${2:-}.pid" ] || die "drain I: no daemon ${2:-} in $RUN_DIR"
           stop_pid "$RUN_DIR/daemon$2.pid" ;;
    stop) for f in "$RUN_DIR"/daemon*.pid; do [ -e "$f" ] && stop_pid "$f"; done
          stop_pid "$RUN_DIR/haproxy.pid" ;;
    *) die "usage: daemons.sh start N [COMMAND ...] | drain I | stop" ;;
esac
