# Shared helpers of the vllm-check matrix (sourced by matrix.sh and the track-*.sh files).
# Needs: D (this folder), RUN (the run folder), B (siesta's binaries), LOCAL (1: fake-vllm).
# Every wait here has a deadline; nothing waits on a fixed sleep for an event.

PY="$D/vcheck.py"
ts() { date -u +%H:%M:%S.%3N; }
now_ms() { date +%s%3N; }
# The detail log: every step, with the track it belongs to.
log() { printf '%s [%s] %s\n' "$(ts)" "${TRACK:-main}" "$*" >>"$RUN/detail.txt"; }
# Runs a command with its output indented into the detail log.
logcmd() {
    {
        printf '%s [%s] $ %s\n' "$(ts)" "${TRACK:-main}" "$*"
        "$@" 2>&1 | sed 's/^/    /'
    } >>"$RUN/detail.txt"
}
# One line per check: `PASS|FAIL|SKIP NAME key=value...`, into output.txt (what is shown).
result() {
    local st=$1
    shift
    printf '%s %s\n' "$st" "$*" >>"$RUN/output.txt"
    log "RESULT $st $*"
    return 0
}
# PASS when $1 is 1, else FAIL.
verdict() { if [ "$1" = 1 ]; then echo PASS; else echo FAIL; fi; }

S() { "$B/siesta" "$@"; }
# A field of `siesta get MODEL -o json`'s model (e.g. pid, state, endpoints.0.url).
mget() { S get "$1" -o json 2>/dev/null | python3 "$PY" get "model.$2"; }
# state(lLEVEL), read at once.
mstate() { S get "$1" -o json 2>/dev/null | python3 "$PY" get model.state model.sleep_level | awk '{printf "%s(l%s)", $1, $2}'; }
# The completion every check sends (temperature 0, so answers must be identical).
cmpl() { printf '{"model":"%s","prompt":"hello world the model is","max_tokens":12,"temperature":0}' "$1"; }
# req METHOD URL [BODY] [TIMEOUT_S]: sets RS (status), RMS (ms), RRA (Retry-After), RTXT (JSON text).
req() {
    local line
    line=$(python3 "$PY" req "$@")
    read -r RS RMS RRA RTXT <<<"$line"
    log "$1 $2 -> $RS in $RMS ms retry-after=$RRA text=$RTXT"
}
# A completion through the proxy.
preq() { req POST "$P/v1/completions" "$(cmpl "$1")" "${2:-$REQ_TIMEOUT}"; }
# waitst MODEL DEADLINE_S TARGET...: each target (state or state:level, `|` for
# alternatives) in order; WAIT_MS holds the elapsed ms of each. Returns 1 on timeout.
waitst() {
    local out rc
    out=$(python3 "$PY" wait "$B/siesta" "$@")
    rc=$?
    log "wait $1 for ${*:3}: $(echo "$out" | tr '\n' ' ')"
    WAIT_MS=$(echo "$out" | awk '$1 != "TIMEOUT" {printf "%s%s", sep, $2; sep=","}')
    WAIT_LAST=$(echo "$out" | tail -1)
    return $rc
}
# Records each answer text for the identity check: label TEXT_JSON.
keep_text() { printf '%s\t%s\n' "$1" "$2" >>"$RUN/texts-${3:-$TRACK}.tsv"; }

# Processes: engines siesta spawned (and their children) carry SIESTA_ENGINE_TAG.
# Only this run's: their output goes to files under its state_dir (other siesta instances
# on this machine, e.g. tests running beside a LOCAL run, have their own).
engines() { python3 "$PY" engines "$RUN/state/"; }
# API servers (group leaders) serving MODEL.
engine_count() { engines | awk -v m="$1" '$1 == $2 && $5 == m' | wc -l; }
# Live (not zombie: a zombie holds no memory) members of process group $1.
group_pids() { ps -eo pid=,pgid=,stat= | awk -v g="$1" '$2 == g && $3 !~ /^Z/ {print $1}' | tr '\n' ' '; }
# EngineCore child of an API server.
engine_core() { ps -eo pid=,ppid=,comm= | awk -v p="$1" '$2 == p && $3 ~ /^VLLM::EngineCor/ {print $1}' | head -1; }

have_nvml() { [ "$LOCAL" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; }
# MiB NVML lists for these pids (per-process accounting), "-" without NVML.
nvml_mib() {
    have_nvml || {
        echo -
        return
    }
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
        awk -F', *' -v list=" $* " 'index(list, " " $1 " ") {s += $2} END {print s + 0}'
}
gpu_used_mib() {
    have_nvml || {
        echo -
        return
    }
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '{s += $1} END {print s + 0}'
}
compute_apps() {
    have_nvml || {
        echo -
        return
    }
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
        awk -F', *' 'NF >= 2 {printf "%s%s:%sMiB", sep, $1, $2; sep=","} END {if (!sep) printf "none"}'
}
mem_snapshot() { have_nvml && logcmd nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader; }

# A pid that may be signalled: a number above 1 (`kill -9 0` or an empty pid would hit
# the caller's own process group).
valid_pid() { [[ "${1:-}" =~ ^[0-9]+$ ]] && [ "$1" -gt 1 ]; }
kill_pid() { # SIGNAL PID
    if valid_pid "$2"; then kill "-$1" "$2"; else log "not signalling invalid pid '$2'"; return 1; fi
}

# Flags between tracks.
flag() { touch "$RUN/flags/$1"; }
wait_flag() {
    local end=$((SECONDS + $2))
    while [ ! -e "$RUN/flags/$1" ]; do
        [ $SECONDS -ge $end ] && return 1
        sleep 0.5
    done
}

# siesta-control, on the address chosen at the first start (port 0), so the proxy and
# the CLI find it again after a restart. Stops every engine when it exits on SIGTERM.
start_control() {
    local tag=$1 end=$((SECONDS + 60)) listen=()
    [ -s "$RUN/control.addr" ] && listen=(--listen "$(sed -n 's/^grpc=//p' "$RUN/control.addr")")
    rm -f "$RUN/control.addr.new"
    setsid "$B/siesta-control" --config "$CFG" "${listen[@]}" --addr-file "$RUN/control.addr.new" \
        --stop-engines-on-exit >"$RUN/logs/control-$tag.log" 2>&1 </dev/null &
    echo $! >"$RUN/control.pid"
    while [ ! -s "$RUN/control.addr.new" ]; do
        if [ $SECONDS -ge $end ] || ! kill -0 "$(cat "$RUN/control.pid")" 2>/dev/null; then
            log "siesta-control ($tag) did not come up"
            tail -20 "$RUN/logs/control-$tag.log" >>"$RUN/detail.txt"
            return 1
        fi
        sleep 0.1
    done
    mv "$RUN/control.addr.new" "$RUN/control.addr"
    export SIESTA_CONTROL="http://$(sed -n 's/^grpc=//p' "$RUN/control.addr")"
    log "siesta-control ($tag) pid $(cat "$RUN/control.pid") at $SIESTA_CONTROL"
    setsid "$B/siesta" watch -o json >>"$RUN/logs/watch.jsonl" 2>&1 </dev/null &
    echo $! >>"$RUN/watch.pids"
}
control_env() { export SIESTA_CONTROL="http://$(sed -n 's/^grpc=//p' "$RUN/control.addr")"; }
proxy_env() { P="http://$(sed -n 's/^http=//p' "$RUN/proxy.addr")"; }

# A matrix's beginning (matrix.sh, suspend.sh): its folders, an empty output, and
# `finish CODE` (writes RUN/done, exits), also on TERM/INT.
matrix_begin() {
    mkdir -p "$RUN/logs" "$RUN/flags" "$RUN/state"
    : >"$RUN/output.txt"
    trap 'log "matrix killed"; finish 1' TERM INT
}
finish() {
    echo "$1" >"$RUN/done.tmp" && mv "$RUN/done.tmp" "$RUN/done"
    exit "$1"
}

# siesta-control on $CFG and siesta-proxy in front of it, both up (proxy /readyz 200), or a
# FAIL stack-up line and `finish 1`; sets and exports P. T0: when the stack was asked for.
stack_up() {
    T0=$SECONDS
    if ! start_control first; then
        result FAIL stack-up control_log=logs/control-first.log
        finish 1
    fi
    setsid "$B/siesta-proxy" --control "$SIESTA_CONTROL" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
        --addr-file "$RUN/proxy.addr" >"$RUN/logs/proxy.log" 2>&1 </dev/null &
    echo $! >"$RUN/proxy.pid"
    local end=$((SECONDS + 60))
    until [ -s "$RUN/proxy.addr" ] && proxy_env && [ "$(python3 "$PY" req GET "$(sed -n 's/^admin=/http:\/\//p' "$RUN/proxy.addr")/readyz" "" 5 | cut -c1-3)" = 200 ]; do
        if [ $SECONDS -ge $end ]; then
            result FAIL stack-up proxy_log=logs/proxy.log
            finish 1
        fi
        sleep 0.2
    done
    proxy_env
    export P
    result PASS stack-up control=$SIESTA_CONTROL proxy=$P up_s=$((SECONDS - T0))
}

# The matrix's last line (`# NAME: P passed, F failed, S skipped in N s`), then `finish`
# with 0 only if nothing failed.
matrix_end() {
    local pass fail skip
    pass=$(grep -c '^PASS' "$RUN/output.txt")
    fail=$(grep -c '^FAIL' "$RUN/output.txt")
    skip=$(grep -c '^SKIP' "$RUN/output.txt")
    log "done: $pass passed, $fail failed, $skip skipped in $((SECONDS - T0)) s"
    echo "# $1: $pass passed, $fail failed, $skip skipped in $((SECONDS - T0)) s (LOCAL=$LOCAL)" >>"$RUN/output.txt"
    [ "$fail" = 0 ] && finish 0
    finish 1
}
