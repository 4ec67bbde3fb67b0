#!/usr/bin/env bash
# `vllm-check crowded`: a process siesta does not run holds most of GPU 0's memory (torch on
# the GPU machine; LOCAL: fake-vllm's simulated GPU with a holder's entry).
# On the GPU machine siesta sees the holder through NVML and plans around it:
# How much is held scales with GPU 0's memory (5/7 and 6/7 of it: 100 and 120 GiB of an H200's
# 140, 56 and 67 of an H100's 79), so the check runs on either card:
#   crowded-start-waits-for-room: 5/7 held; a model of gpu_memory 0.5 asked for there
#     is not started: `siesta wake --wait --timeout 30s` ends without it, the model's
#     `waiting_for` names the holder's pid and what it holds; once the holder exits, the
#     same wake (still queued) starts it, answered 200.
#   crowded-wake-waits-for-room: asleep at level 1, then 6/7 held and it is woken: the
#     wake waits (engine alive, asleep, `waiting_for` names the holder), and completes once
#     the holder exits; the answer after it is 200.
# LOCAL (no NVML: siesta-control cannot see the simulated GPU) siesta admits both and
# fake-vllm refuses them as vLLM does when siesta cannot see the holder:
#   crowded-start-says-why: the failed `siesta wake --wait` and `last_error` say why in
#     vLLM's own words (`ValueError: Free memory on device ...`), not only "exit status: 1".
#   crowded-wake-says-why: the wake runs out of memory, and siesta says so.
# About three minutes.
set -uo pipefail
: "${D:?}" "${RUN:?}" "${B:?}" "${EXE:?}" "${MODEL:?}" "${LOCAL:?}"
source "$D/lib.sh"
TRACK=crowded
matrix_begin
T0=$SECONDS
CFG="$RUN/siesta.toml"
export CFG
HOLDER=
# hold GIB: a process siesta does not run takes GIB of GPU 0 (until `release`).
hold() {
    if [ "$LOCAL" = 1 ]; then
        mkdir -p "$RUN/simgpu/gpu-0"
        sleep 600 &
        HOLDER=$!
        echo $(($1 << 30)) >"$RUN/simgpu/gpu-0/$HOLDER"
    else
        python3 "$D/../gpu-hold.py" "$1" 600 >"$RUN/logs/holder-$1.log" 2>&1 &
        HOLDER=$!
        local end=$((SECONDS + 120))
        until grep -q held "$RUN/logs/holder-$1.log" 2>/dev/null || ! kill -0 "$HOLDER" 2>/dev/null ||
            [ $SECONDS -ge $end ]; do sleep 0.5; done
        grep -q held "$RUN/logs/holder-$1.log" 2>/dev/null ||
            log "the holder did not take $1 GiB: $(tail -3 "$RUN/logs/holder-$1.log" 2>/dev/null)"
    fi
    log "holder pid $HOLDER holds $1 GiB; GPU memory used: $(gpu_used_mib) MiB"
}
release() {
    [ -n "$HOLDER" ] && kill "$HOLDER" 2>/dev/null && wait "$HOLDER" 2>/dev/null
    HOLDER=
}
trap release EXIT
# LOCAL: siesta cannot see the holder; fake-vllm refuses as vLLM does.
crowded_local() {
    local out rc state err ok PID alive
    out=$(S wake crowded --wait --timeout 6m 2>&1)
    rc=$?
    log "siesta wake crowded --wait (exit $rc): $out"
    state=$(mget crowded state)
    err=$(mget crowded last_error)
    ok=1
    [ "$rc" = 1 ] && [ "$state" = failed ] && [[ "$err" == *"exited unexpectedly"*": ValueError: Free memory on device"* ]] &&
        [[ "$out" == *"ValueError: Free memory on device"* ]] || ok=0
    result "$(verdict $ok)" crowded-start-says-why wake_exit=$rc state=$state last_error="$err"

    release
    out=$(S wake crowded --wait --timeout 6m 2>&1)
    rc=$?
    log "siesta wake crowded --wait, GPU free (exit $rc): $out"
    S sleep crowded --level 1 --wait --timeout 2m >/dev/null 2>&1
    state=$(mstate crowded)
    PID=$(mget crowded pid)
    if [ "$rc" != 0 ] || [ "$state" != "asleep(l1)" ]; then
        result FAIL crowded-wake-says-why "not started and asleep: wake_exit=$rc state=$state"
        return
    fi
    hold "$WAKE_HOLD"
    out=$(S wake crowded --wait --timeout 4m 2>&1)
    rc=$?
    log "siesta wake crowded --wait, $WAKE_HOLD GiB held (exit $rc): $out"
    state=$(mstate crowded)
    err=$(mget crowded last_error)
    alive=$(kill -0 "$PID" 2>/dev/null && echo yes || echo no)
    ok=1
    [ "$rc" = 1 ] && [[ "${err,,}" == *"out of memory"* ]] || ok=0
    result "$(verdict $ok)" crowded-wake-says-why wake_exit=$rc state=$state engine_alive=$alive last_error="$err"
    release
}

# NVML: siesta sees the holder and waits for it, naming it.
crowded_nvml() {
    local out rc state why ok PID alive t0 ms after same
    out=$(S wake crowded --wait --timeout 30s 2>&1)
    rc=$?
    log "siesta wake crowded --wait --timeout 30s, $START_HOLD GiB held (exit $rc): $out"
    state=$(mget crowded state)
    why=$(mget crowded waiting_for)
    logcmd S placement
    ok=1
    [ "$rc" != 0 ] && [ "$state" = starting ] && [[ "$why" == *"processes siesta does not run: pid $HOLDER ("* ]] || ok=0
    release
    t0=$SECONDS
    out=$(S wake crowded --wait --timeout 6m 2>&1)
    rc=$?
    log "siesta wake crowded --wait, holder gone (exit $rc): $out"
    after=$(mget crowded state)
    [ "$rc" = 0 ] && [ "$after" = awake ] || ok=0
    result "$(verdict $ok)" crowded-start-waits-for-room state_while_held=$state waiting_for="$why" \
        started_after_release_s=$((SECONDS - t0)) state_after=$after

    S sleep crowded --level 1 --wait --timeout 2m >/dev/null 2>&1
    state=$(mstate crowded)
    PID=$(mget crowded pid)
    if [ "$state" != "asleep(l1)" ]; then
        result FAIL crowded-wake-waits-for-room "not asleep: state=$state"
        return
    fi
    hold "$WAKE_HOLD"
    out=$(S wake crowded --wait --timeout 30s 2>&1)
    rc=$?
    log "siesta wake crowded --wait --timeout 30s, $WAKE_HOLD GiB held (exit $rc): $out"
    state=$(mget crowded state)
    why=$(mget crowded waiting_for)
    alive=$(kill -0 "$PID" 2>/dev/null && echo yes || echo no)
    ok=1
    [ "$rc" != 0 ] && [ "$state" = waking ] && [ "$alive" = yes ] &&
        [[ "$why" == *"processes siesta does not run: pid $HOLDER ("* ]] || ok=0
    release
    t0=$SECONDS
    out=$(S wake crowded --wait --timeout 4m 2>&1)
    rc=$?
    ms=$(((SECONDS - t0) * 1000))
    log "siesta wake crowded --wait, holder gone (exit $rc): $out"
    after=$(mget crowded state)
    same=$([ "$(mget crowded pid)" = "$PID" ] && echo yes || echo no)
    [ "$rc" = 0 ] && [ "$after" = awake ] && [ "$same" = yes ] || ok=0
    result "$(verdict $ok)" crowded-wake-waits-for-room state_while_held=$state engine_alive=$alive \
        waiting_for="$why" woke_after_release_ms=$ms state_after=$after same_pid=$same
}
if [ "$LOCAL" = 1 ]; then
    TOTAL_GIB=140
    GPU=$'\n[[gpu]]\nindex = 0\nname = "fake"\nmemory = "140GiB"'
    ENV="env = { FAKE_VLLM_GPU_TOTAL_BYTES = \"$((140 << 30))\", FAKE_VLLM_GPU_DIR = \"$RUN/simgpu\" }"
else
    TOTAL_GIB=$(($(nvidia-smi -i 0 --query-gpu=memory.total --format=csv,noheader,nounits) >> 10))
    GPU= ENV=
fi
# Held beside a model of half the GPU: 5/7 leaves less than half free (the start must wait);
# 6/7 still fits beside the model asleep at level 1 (its ~1 GiB), not beside it awake.
START_HOLD=$((TOTAL_GIB * 5 / 7))
WAKE_HOLD=$((TOTAL_GIB * 6 / 7))
log "GPU 0: $TOTAL_GIB GiB; held: $START_HOLD GiB at the start, $WAKE_HOLD GiB at the wake"
hold "$START_HOLD"
cat >"$CFG" <<T
[control]
listen = "127.0.0.1:0"
state_dir = "$RUN/state"
p2p_probe = "off"

[defaults]
start_timeout = "6m"
backoff_initial = "5m"
$GPU

[[model]]
name = "crowded"
model = "$MODEL"
executable = "$EXE"
gpus = 1
gpu_ids = [0]
gpu_memory = 0.5
args = ["--enforce-eager"]
$ENV
T
logcmd cat "$CFG"
start_control first || {
    result FAIL crowded-stack control_log=logs/control-first.log
    finish 1
}
if [ "$LOCAL" = 1 ]; then
    crowded_local
else
    crowded_nvml
fi
kill -TERM "$(cat "$RUN/control.pid")" 2>/dev/null
end=$((SECONDS + 60))
while kill -0 "$(cat "$RUN/control.pid")" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
matrix_end vllm-check-crowded
