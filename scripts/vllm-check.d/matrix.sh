#!/usr/bin/env bash
# The vllm-check matrix: one siesta-control + siesta-proxy driving real vLLM (or fake-vllm
# with LOCAL=1) through every check, then shutdown. Started detached by `vllm-check run`;
# writes RUN/output.txt (one line per check), RUN/detail.txt, RUN/logs/, RUN/done (exit code).
#
# Engines and GPUs (NG = GPU count; LOCAL: two fake GPUs of 140 GiB):
#   tiny  GPU 0, gpu_memory 0.2, preload asleep, tiers L1 5s / L2 12s / stop 40s:
#         checks 1, 2, 3, 4, 7, 8, 9-stop, overhead          (track-tiny.sh)
#   a, b  GPU 1 (GPU 0 when NG = 1), gpu_memory 0.55 each, preload asleep: both cannot be
#         awake on one GPU, so they swap: check 5             (track-swap.sh)
#   tp2   GPUs 0+1, gpu_memory 0.2, preload none: check 6    (track-tp.sh, NG >= 2)
# tiny and swap run in parallel (different GPUs); tp2 starts once they are done, so no
# engine profiles its memory while another one's allocations move on the same GPU.
set -uo pipefail
: "${D:?}" "${RUN:?}" "${B:?}" "${EXE:?}" "${MODEL:?}" "${LOCAL:?}"
source "$D/lib.sh"
TRACK=main
matrix_begin

if [ "$LOCAL" = 1 ]; then
    NG=2
    T_L1=3 T_L2=8 T_STOP=25 T_FIRST=11 BACKOFF=3
    START_DEADLINE=60 REQ_TIMEOUT=60 WAKE_REQ_TIMEOUT=30 STOP_DEADLINE=30
    # fake-vllm's timings: a start long enough to kill siesta-control during it.
    # 300 tokens a second: check 9's stream of 600 lasts 2 s, the stop comes during it.
    FAKE_ENV='env = { FAKE_VLLM_STARTUP_TIME = "3s", FAKE_VLLM_WAKE_TIME = "200ms", FAKE_VLLM_RELOAD_TIME = "200ms", FAKE_VLLM_TOKENS_PER_SECOND = "300" }'
else
    NG=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    T_L1=5 T_L2=12 T_STOP=40 T_FIRST=20 BACKOFF=10
    # One GPU: tiny's L2 tier goes through a wake, which waits for admission while
    # a and b start on the same GPU (33 s on 2026-12-01); with the stop tier at 40 s
    # that wait could outlast it and tiny was stopped, never seen at L2.
    ((NG >= 2)) || T_STOP=90
    START_DEADLINE=420 REQ_TIMEOUT=330 WAKE_REQ_TIMEOUT=60 STOP_DEADLINE=90
    FAKE_ENV=
fi
SWAP_GPU=$((NG >= 2 ? 1 : 0))
# Check 9's stream, under way when `siesta stop` comes (the tiny model's context is 2048).
STREAM_TOKENS=600
export STREAM_TOKENS NG T_L1 T_L2 T_STOP T_FIRST BACKOFF START_DEADLINE REQ_TIMEOUT WAKE_REQ_TIMEOUT STOP_DEADLINE SWAP_GPU
log "LOCAL=$LOCAL NG=$NG EXE=$EXE MODEL=$MODEL B=$B"
logcmd uname -a
have_nvml && logcmd nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv
BASE_MIB=$(gpu_used_mib)
log "GPU memory used before any engine: $BASE_MIB MiB"

CFG="$RUN/siesta.toml"
export CFG
model() { # name gpu-lines preload extra-lines
    cat <<T

[[model]]
name = "$1"
model = "$MODEL"
executable = "$EXE"
$2
preload = "$3"
args = ["--enforce-eager"]
$4
$FAKE_ENV
T
}
{
    cat <<T
[control]
listen = "127.0.0.1:0"
state_dir = "$RUN/state"
p2p_probe = "$([ "$LOCAL" != 1 ] && [ "$NG" -ge 2 ] && echo start || echo off)"

[defaults]
idle = [ { after = "10m", action = "sleep", level = 1 } ]
max_hold = "5m"
start_timeout = "6m"
wake_timeout = "2m"
sleep_timeout = "1m"
stop_grace = "20s"
backoff_initial = "${BACKOFF}s"
backoff_max = "30s"
T
    model tiny $'gpus = 1\ngpu_ids = [0]\ngpu_memory = 0.2' asleep \
        "idle = [ { after = \"${T_L1}s\", action = \"sleep\", level = 1 }, { after = \"${T_L2}s\", action = \"sleep\", level = 2 }, { after = \"${T_STOP}s\", action = \"stop\" } ]
aliases = [\"tiny-alias\"]"
    for m in a b; do model $m "gpus = 1"$'\n'"gpu_ids = [$SWAP_GPU]"$'\n'"gpu_memory = 0.55" asleep ""; done
    [ "$NG" -ge 2 ] && model tp2 $'gpus = 2\ngpu_memory = 0.2' none ""
    if [ "$LOCAL" = 1 ]; then
        printf '\n[[gpu]]\nindex = %s\nname = "fake"\nmemory = "140GiB"\n' 0 1
    fi
} >"$CFG"
logcmd cat "$CFG"
if out=$(S config check "$CFG" 2>&1); then
    result PASS config models=$(grep -c '^\[\[model\]\]' "$CFG") gpus=$NG
else
    result FAIL config "$(echo "$out" | tr '\n' ' ')"
    finish 1
fi

# --- the stack
stack_up
logcmd S gpus
logcmd S placement

# --- tracks
TRACK=tiny bash "$D/track-tiny.sh" &
TINY=$!
TRACK=swap bash "$D/track-swap.sh" &
SWAP=$!
wait $SWAP $TINY
if [ "$NG" -ge 2 ]; then
    TRACK=tp bash "$D/track-tp.sh"
else
    result SKIP 6-tp2 "one GPU: tensor parallel 2 needs two"
fi

# --- 9: daemon shutdown (SIGTERM, --stop-engines-on-exit) leaves no engine and no GPU memory
TRACK=shutdown
control_env
logcmd S status
before=$(engines | wc -l)
CPID=$(cat "$RUN/control.pid")
t=$(now_ms)
kill_pid TERM "$CPID"
end=$((SECONDS + 150))
while kill -0 "$CPID" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
exited=$(kill -0 "$CPID" 2>/dev/null && echo no || echo yes)
ms=$(($(now_ms) - t))
left=$(engines | wc -l)
end=$((SECONDS + 30))
while [ "$left" -gt 0 ] && [ $SECONDS -lt $end ]; do
    sleep 0.5
    left=$(engines | wc -l)
done
logcmd engines
mem_snapshot
apps=$(compute_apps)
used=$(gpu_used_mib)
ok=1
[ "$exited" = yes ] && [ "$left" = 0 ] || ok=0
[ "$apps" = - ] || [ "$apps" = none ] || ok=0
result "$(verdict $ok)" 9-shutdown control_exited=$exited in_ms=$ms engine_processes_before=$before after=$left \
    nvml_apps=$apps gpu_used_mib=$used baseline_mib=$BASE_MIB
kill_pid TERM "$(cat "$RUN/proxy.pid")" 2>/dev/null
for w in $(cat "$RUN/watch.pids" 2>/dev/null); do kill_pid TERM "$w" 2>/dev/null; done
# Anything still tagged as siesta's engine is killed by pid (never by name).
for p in $(engines | awk '{print $1}'); do kill_pid KILL "$p" 2>/dev/null; done

matrix_end vllm-check
