#!/usr/bin/env bash
# The suspend matrix (issue 17), started detached by `vllm-check suspend`: real vLLM 0.24.0
# WITHOUT sleep mode, run as `engine = "openai"` (siesta adds nothing to the operator's
# `vllm serve` argv: no --enable-sleep-mode, no dev endpoints), suspended by siesta's CUDA
# checkpoint helper and restored through the proxy. Writes RUN/output.txt (one line per
# check), RUN/detail.txt, RUN/logs/, RUN/done (exit code), like matrix.sh.
#
#   s1  GPU 0, TP=1, preload awake, idle tier `suspend` after T_IDLE s:
#       S1 the tier suspends it: NVML shows its processes' memory gone, host memory takes it
#       S2 N requests at once through the proxy while suspended: held, the restore runs, all
#          200, answers identical to the one before the suspend, the same pid (not restarted)
#       S3 `siesta suspend` then `siesta wake --wait`: the same again
#   s2  GPUs 0+1, TP=2 (two worker processes), preload none (after s1 is stopped), a suspend
#       tier (so siesta starts it sharing no GPU memory between its processes: NCCL P2P and
#       cuMem off, no symmetric-memory all-reduce; the operator's argv adds vLLM's
#       --disable-custom-all-reduce, as the README says for an `openai` engine):
#       S4 started by a request; `siesta suspend`: every CUDA process of the engine is
#          checkpointed (one per GPU), NVML shows both GPUs' share gone; a request through
#          the proxy restores it: 200, identical answer, same pid
#   S5 daemon shutdown: no engine process, no GPU memory left
# Knobs: ONLY=s2 (skip s1), S2_ARGS (s2's extra `vllm serve` flags; default
# --disable-custom-all-reduce), S2_ENV (TOML pairs for s2's env, e.g. 'NCCL_SHM_DISABLE = "1"').
# LOCAL=1: fake-vllm (no sleep mode) is the engine and `fake-cuda-checkpoint` (SIGSTOP) the
# helper; NVML figures print "-".
set -uo pipefail
: "${D:?}" "${RUN:?}" "${B:?}" "${EXE:?}" "${MODEL:?}" "${LOCAL:?}"
source "$D/lib.sh"
TRACK=suspend
matrix_begin

if [ "$LOCAL" = 1 ]; then
    NG=2 T_IDLE=4 START_DEADLINE=60 REQ_TIMEOUT=60 OP_DEADLINE=30
    TOOL=$B/fake-cuda-checkpoint
    UTIL=()
else
    NG=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    T_IDLE=20 START_DEADLINE=420 REQ_TIMEOUT=330 OP_DEADLINE=180
    TOOL=$B/siesta-cuda-checkpoint
    UTIL=(--gpu-memory-utilization 0.1 --enforce-eager)
fi
N_AT_ONCE=${N_AT_ONCE:-8}
export REQ_TIMEOUT
log "LOCAL=$LOCAL NG=$NG EXE=$EXE MODEL=$MODEL B=$B TOOL=$TOOL"
have_nvml && logcmd nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv
BASE_MIB=$(gpu_used_mib)

CFG="$RUN/siesta.toml"
export CFG
toml_list() { local s="" a; for a in "$@"; do s+="${s:+, }\"$a\""; done; echo "[$s]"; }
# The operator's own `vllm serve` line: siesta fills in {host}, {port}, {name} only.
args() { toml_list serve "$MODEL" --host "{host}" --port "{port}" --served-model-name "{name}" "${UTIL[@]}" "$@"; }
{
    cat <<T
[control]
listen = "127.0.0.1:0"
state_dir = "$RUN/state"
p2p_probe = "off"
cuda_checkpoint = "$TOOL"

[defaults]
idle = []
max_hold = "5m"
start_timeout = "7m"
wake_timeout = "3m"
stop_grace = "20s"

[[model]]
name = "s1"
engine = "openai"
model = "$MODEL"
executable = "$EXE"
args = $(args)
gpus = 1
gpu_ids = [0]
gpu_memory = 0.12
preload = "awake"
idle = [ { after = "${T_IDLE}s", action = "suspend" } ]
T
    [ "$NG" -ge 2 ] && cat <<T

[[model]]
name = "s2"
engine = "openai"
model = "$MODEL"
executable = "$EXE"
args = $(args --tensor-parallel-size 2 ${S2_ARGS---disable-custom-all-reduce})
${S2_ENV:+env = { $S2_ENV \}}
gpus = 2
gpu_memory = 0.12
preload = "none"
idle = [ { after = "1h", action = "suspend" } ]
T
    if [ "$LOCAL" = 1 ]; then
        printf '\n[[gpu]]\nindex = %s\nname = "fake"\nmemory = "140GiB"\n' 0 1
    fi
} >"$CFG"
logcmd cat "$CFG"
if out=$(S config check "$CFG" 2>&1); then
    result PASS config models=$(grep -c '^\[\[model\]\]' "$CFG") gpus=$NG engine=openai sleep_mode=none
else
    result FAIL config "$(echo "$out" | tr '\n' ' ')"
    finish 1
fi

stack_up

mem_avail_mib() { awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo; }
# The helper's times from the model's log: `suspend: pid 12 lock 3 ms checkpoint 2301 ms; ...`.
op_line() { S logs "$1" --tail 400 2>/dev/null | grep -E "siesta.*$2: pid" | tail -1 | sed "s/.*$2: //"; }
pids_in() { grep -o 'pid [0-9]*' <<<"$1" | wc -l; }
sum_ms() { grep -oE "$2 [0-9]+ ms" <<<"$1" | awk '{s += $2} END {print s + 0}'; }
max_ms() { grep -oE "$2 [0-9]+ ms" <<<"$1" | awk '$2 > m {m = $2} END {print m + 0}'; }

# --- s1: awake, answered once (the reference answer)
TRACK=s1
if [ "${ONLY:-}" = s2 ]; then
    result SKIP S1-S3 "ONLY=s2"
    S stop s1 >>"$RUN/detail.txt" 2>&1
    waitst s1 "$OP_DEADLINE" stopped
elif ! waitst s1 "$START_DEADLINE" awake; then
    result FAIL S1-idle-suspend "s1 never awake: $WAIT_LAST"
    finish 1
else
preq s1
REF=$RTXT
keep_text before "$RTXT"
PID=$(mget s1 pid)
R0=$(mget s1 restarts)
GROUP=$(group_pids "$PID")
awake_mib=$(nvml_mib $GROUP)
avail_awake=$(mem_avail_mib)
mem_snapshot
log "s1 awake: pid $PID group [$GROUP] $awake_mib MiB; answer $RS $REF"

# S1: the idle tier suspends it.
ok=1
waitst s1 $((T_IDLE + OP_DEADLINE)) suspended || ok=0
susp_mib=$(nvml_mib $GROUP)
avail_susp=$(mem_avail_mib)
mem_snapshot
line=$(op_line s1 suspend)
[ "$RS" = 200 ] && [ "$REF" != '""' ] || ok=0
if have_nvml; then
    # The engine's processes hold (almost) nothing on the GPU: under 2 % of what they held.
    [ "${susp_mib:-0}" -le $((awake_mib / 50)) ] && [ "$awake_mib" -gt 1000 ] || ok=0
fi
[ "$(pids_in "$line")" -ge 1 ] || ok=0
result "$(verdict $ok)" S1-idle-suspend state=$(mstate s1) nvml_group_mib=awake:$awake_mib,suspended:$susp_mib \
    host_mem_available_mib=$avail_awake,$avail_susp checkpointed_pids=$(pids_in "$line") \
    checkpoint_ms=$(max_ms "$line" checkpoint) lock_ms=$(max_ms "$line" lock) tier_after_s=$T_IDLE
logcmd S get s1

# S2: N requests at once while suspended: held, restored, all answered the same.
t=$(now_ms)
out=$(python3 "$PY" many "$P/v1/completions" s1 "$N_AT_ONCE" "$REQ_TIMEOUT" 2>>"$RUN/detail.txt")
ms=$(($(now_ms) - t))
log "many: $out"
line=$(op_line s1 resume)
PID2=$(mget s1 pid)
text=$(sed 's/.* text=//' <<<"$out")
ok=1
[[ "$out" == ok=$N_AT_ONCE\ * ]] && [[ "$out" == *distinct_texts=1\ * ]] && [ "$text" = "$REF" ] && [ "$PID" = "$PID2" ] || ok=0
[ "$(mget s1 state)" = awake ] || ok=0
[ "$(mget s1 restarts)" = "$R0" ] || ok=0
keep_text after-idle-resume "$text"
result "$(verdict $ok)" S2-resume-through-proxy requests=$N_AT_ONCE all_answered_ms=$ms \
    "$(sed 's/ text=.*//' <<<"$out")" identical_to_before=$([ "$text" = "$REF" ] && echo yes || echo no) \
    pid=$PID/$PID2 restarts=$R0/$(mget s1 restarts) restore_ms=$(max_ms "$line" restore) \
    nvml_group_mib_after=$(nvml_mib $GROUP) text=$text

# S3: siesta suspend, siesta wake --wait.
ok=1
t=$(now_ms)
S suspend s1 >>"$RUN/detail.txt" 2>&1 || ok=0
waitst s1 "$OP_DEADLINE" suspended || ok=0
susp_ms=$(($(now_ms) - t))
susp_mib=$(nvml_mib $GROUP)
t=$(now_ms)
S wake s1 --wait >>"$RUN/detail.txt" 2>&1 || ok=0
wake_ms=$(($(now_ms) - t))
preq s1
keep_text after-cli-wake "$RTXT"
[ "$RS" = 200 ] && [ "$RTXT" = "$REF" ] && [ "$(mget s1 pid)" = "$PID" ] || ok=0
have_nvml && { [ "${susp_mib:-0}" -le $((awake_mib / 50)) ] || ok=0; }
result "$(verdict $ok)" S3-cli-suspend-wake suspend_ms=$susp_ms nvml_group_mib_suspended=$susp_mib wake_ms=$wake_ms \
    status=$RS identical_to_before=$([ "$RTXT" = "$REF" ] && echo yes || echo no) pid=$(mget s1 pid) \
    calibration="$(S get s1 -o json 2>/dev/null | python3 "$PY" get model.calibration | tr -d ' ')"
S stop s1 >>"$RUN/detail.txt" 2>&1
waitst s1 "$OP_DEADLINE" stopped
fi

# --- s2: TP=2, two worker processes on two GPUs
TRACK=s2
if [ "$NG" -ge 2 ]; then
    preq s2 "$REQ_TIMEOUT"
    REF2=$RTXT
    keep_text tp2-before "$RTXT"
    PID=$(mget s2 pid)
    R0=$(mget s2 restarts)
    GROUP=$(group_pids "$PID")
    awake_mib=$(nvml_mib $GROUP)
    apps_awake=$(compute_apps)
    mem_snapshot
    ok=1
    [ "$RS" = 200 ] || ok=0
    t=$(now_ms)
    S suspend s2 >>"$RUN/detail.txt" 2>&1 || ok=0
    waitst s2 "$OP_DEADLINE" suspended || ok=0
    susp_ms=$(($(now_ms) - t))
    susp_mib=$(nvml_mib $GROUP)
    apps_susp=$(compute_apps)
    mem_snapshot
    sline=$(op_line s2 suspend)
    preq s2
    keep_text tp2-after "$RTXT"
    rline=$(op_line s2 resume)
    [ "$RS" = 200 ] && [ "$RTXT" = "$REF2" ] && [ "$(mget s2 pid)" = "$PID" ] && [ "$(mget s2 restarts)" = "$R0" ] || ok=0
    [ "$(pids_in "$sline")" -ge 2 ] || ok=0
    # What siesta set because s2 has a suspend tier (the engine's own environment).
    noshare=$(tr '\0' '\n' <"/proc/$PID/environ" 2>/dev/null | grep -E '^(NCCL_P2P_DISABLE|NCCL_CUMEM_ENABLE|VLLM_ALLREDUCE_USE_SYMM_MEM)=' | sort | tr '\n' ',')
    [ "$noshare" = "NCCL_CUMEM_ENABLE=0,NCCL_P2P_DISABLE=1,VLLM_ALLREDUCE_USE_SYMM_MEM=0," ] || ok=0
    have_nvml && { [ "${susp_mib:-0}" -le $((awake_mib / 50)) ] || ok=0; }
    result "$(verdict $ok)" S4-tp2-suspend-resume status=$RS ms=$RMS identical=$([ "$RTXT" = "$REF2" ] && echo yes || echo no) \
        same_as_tp1=$([ "$RTXT" = "$REF" ] && echo yes || echo no) pid=$PID/$(mget s2 pid) \
        checkpointed_pids=$(pids_in "$sline") nvml_group_mib=awake:$awake_mib,suspended:$susp_mib \
        suspend_ms=$susp_ms checkpoint_ms=$(max_ms "$sline" checkpoint) restore_ms=$(max_ms "$rline" restore) \
        apps_awake=$apps_awake apps_suspended=$apps_susp env_set_by_siesta=$noshare text=$RTXT
else
    result SKIP S4-tp2-suspend-resume "one GPU: tensor parallel 2 needs two"
fi

# --- S5: daemon shutdown leaves nothing
TRACK=shutdown
logcmd S status
CPID=$(cat "$RUN/control.pid")
kill_pid TERM "$CPID"
end=$((SECONDS + 150))
while kill -0 "$CPID" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
end=$((SECONDS + 30))
while [ "$(engines | wc -l)" -gt 0 ] && [ $SECONDS -lt $end ]; do sleep 0.5; done
# The driver gives a dead process's memory back a few seconds later.
end=$((SECONDS + 30))
while have_nvml && [ "$(gpu_used_mib)" -gt $((BASE_MIB + 100)) ] && [ $SECONDS -lt $end ]; do sleep 0.5; done
left=$(engines | wc -l)
apps=$(compute_apps)
ok=1
! kill -0 "$CPID" 2>/dev/null && [ "$left" = 0 ] || ok=0
[ "$apps" = - ] || [ "$apps" = none ] || ok=0
have_nvml && { [ "$(gpu_used_mib)" -le $((BASE_MIB + 100)) ] || ok=0; }
result "$(verdict $ok)" S5-shutdown engine_processes_left=$left nvml_apps=$apps gpu_used_mib=$(gpu_used_mib) baseline_mib=$BASE_MIB
kill_pid TERM "$(cat "$RUN/proxy.pid")" 2>/dev/null
for w in $(cat "$RUN/watch.pids" 2>/dev/null); do kill_pid TERM "$w" 2>/dev/null; done
for p in $(engines | awk '{print $1}'); do kill_pid KILL "$p" 2>/dev/null; done

matrix_end "vllm-check suspend"
