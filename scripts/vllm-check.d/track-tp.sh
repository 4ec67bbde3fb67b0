#!/usr/bin/env bash
# Check 6: tensor parallel 2 on GPUs 0+1: started by a request, slept at level 1 and 2, woken
# by requests through the proxy; answers identical; the P2P verdict siesta acted on and the
# NCCL environment the engine really ran with (/proc/PID/environ). Run by matrix.sh after
# the other tracks, so nothing else moves memory on these GPUs while it starts.
set -uo pipefail
source "$D/lib.sh"
proxy_env
control_env
M=tp2
texts=() statuses=() ms=()
ask() { # label
    preq $M
    statuses+=("$1:$RS")
    ms+=("$1:$RMS")
    texts+=("$RTXT")
    keep_text "$1" "$RTXT"
}
ask cold-start
PID=$(mget $M pid)
logcmd S get $M
awake_mib=$(nvml_mib $(group_pids "$PID"))
mem_snapshot
S sleep $M --level 1 >/dev/null 2>&1
waitst $M 120 asleep:1
l1_mib=$(nvml_mib $(group_pids "$PID"))
mem_snapshot
ask l1-wake
S sleep $M --level 2 >/dev/null 2>&1
waitst $M 120 asleep:2
l2_mib=$(nvml_mib $(group_pids "$PID"))
S placement -o json >"$RUN/placement-tp2.json" 2>/dev/null
S status -o json >"$RUN/status-tp2.json" 2>/dev/null
read -r res_bytes res_measured < <(S get $M -o json | python3 "$PY" get model.asleep_residual_bytes model.asleep_residual_measured)
res_mib=$((${res_bytes:-0} / 1048576))
ask l2-wake
PID2=$(mget $M pid)
distinct=$(printf '%s\n' "${texts[@]}" | sort -u | wc -l)
tp1_ref=$(cut -f2 "$RUN/texts-tiny.tsv" 2>/dev/null | sort | uniq -c | sort -rn | head -1 | sed 's/^ *[0-9]* //')
ok=1
for s in "${statuses[@]}"; do [[ "$s" == *:200 ]] || ok=0; done
[ "$distinct" = 1 ] && [ "${texts[0]}" != '""' ] && [ "$PID" = "$PID2" ] || ok=0
result "$(verdict $ok)" 6-tp2 requests="${statuses[*]}" ms="${ms[*]}" distinct_answers=$distinct \
    same_as_tp1=$([ "${texts[0]}" = "$tp1_ref" ] && echo yes || echo no) pid=$PID/$PID2 \
    nvml_group_mib=awake:$awake_mib,l1:$l1_mib,l2:$l2_mib siesta_residual_per_gpu_mib="$res_mib/$([ "$res_measured" = true ] && echo measured || echo default)" start_ms=$(mget $M calibration.start_ms) text=${texts[0]}

# The verdict siesta placed the model with, and the environment the engine got.
S gpus -o json >"$RUN/gpus.json" 2>/dev/null
verdict_p2p=$(python3 "$PY" p2p "$RUN/gpus.json")
disabled=$(mget $M p2p_disabled)
envs=$(python3 "$PY" environ "$PID")
cvd=$(echo "$envs" | tr ' ' '\n' | sed -n 's/^CUDA_VISIBLE_DEVICES=//p')
ok=1
[ "$(echo "$cvd" | tr ',' '\n' | grep -c .)" = 2 ] || ok=0
args_has_flag=$(tr '\0' ' ' <"/proc/$PID/cmdline" 2>/dev/null | grep -c -- --disable-custom-all-reduce)
# Both pairs probed ok: P2P stays on. Any pair not ok, or not probed: NCCL_P2P_DISABLE=1
# and --disable-custom-all-reduce.
if [[ ",$verdict_p2p," == *",0->1:ok,"* && ",$verdict_p2p," == *",1->0:ok,"* ]]; then
    [ "$disabled" = false ] && [[ " $envs " != *" NCCL_P2P_DISABLE=1 "* ]] && [ "$args_has_flag" = 0 ] || ok=0
else
    [ "$disabled" = true ] && [[ " $envs " == *" NCCL_P2P_DISABLE=1 "* ]] && [ "$args_has_flag" = 1 ] || ok=0
fi
result "$(verdict $ok)" 6-tp2-p2p-env p2p=$verdict_p2p p2p_disabled=$disabled disable_custom_all_reduce=$args_has_flag \
    env="$envs"
flag tp-done
