#!/usr/bin/env bash
# `vllm-check crowded`: a process siesta does not run holds most of GPU 0's memory (100 GiB of
# torch on the GPU machine; LOCAL: fake-vllm's simulated GPU with a holder's entry). A model
# asked for there cannot start: vLLM refuses, with less free memory than its
# --gpu-memory-utilization asks for. siesta must say why in vLLM's own words, in the failed
# `siesta wake --wait` and in `last_error`, not only "exit status: 1". About a minute.
set -uo pipefail
: "${D:?}" "${RUN:?}" "${B:?}" "${EXE:?}" "${MODEL:?}" "${LOCAL:?}"
source "$D/lib.sh"
TRACK=crowded
matrix_begin
T0=$SECONDS
CFG="$RUN/siesta.toml"
export CFG
if [ "$LOCAL" = 1 ]; then
    mkdir -p "$RUN/simgpu/gpu-0"
    sleep 600 &
    HOLDER=$!
    echo $((100 << 30)) >"$RUN/simgpu/gpu-0/$HOLDER"
    GPU=$'\n[[gpu]]\nindex = 0\nname = "fake"\nmemory = "140GiB"'
    ENV="env = { FAKE_VLLM_GPU_TOTAL_BYTES = \"$((140 << 30))\", FAKE_VLLM_GPU_DIR = \"$RUN/simgpu\" }"
else
    python3 -c 'import time, torch
x = torch.empty(100 << 30, dtype=torch.uint8, device="cuda:0")
print("held", flush=True)
time.sleep(600)' >"$RUN/logs/holder.log" 2>&1 &
    HOLDER=$!
    end=$((SECONDS + 120))
    until grep -q held "$RUN/logs/holder.log" 2>/dev/null || [ $SECONDS -ge $end ]; do sleep 0.5; done
    GPU= ENV=
fi
trap 'kill $HOLDER 2>/dev/null' EXIT
log "holder pid $HOLDER; GPU memory used: $(gpu_used_mib) MiB"
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
out=$(S wake crowded --wait --timeout 6m 2>&1)
rc=$?
log "siesta wake crowded --wait (exit $rc): $out"
state=$(mget crowded state)
err=$(mget crowded last_error)
ok=1
[ "$rc" = 1 ] && [ "$state" = failed ] && [[ "$err" == *"exited unexpectedly"*": ValueError: Free memory on device"* ]] &&
    [[ "$out" == *"ValueError: Free memory on device"* ]] || ok=0
result "$(verdict $ok)" crowded-start-says-why wake_exit=$rc state=$state last_error="$err"
kill -TERM "$(cat "$RUN/control.pid")" 2>/dev/null
end=$((SECONDS + 60))
while kill -0 "$(cat "$RUN/control.pid")" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
matrix_end vllm-check-crowded
