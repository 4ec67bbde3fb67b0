#!/usr/bin/env bash
# Check 5: two models on one GPU that cannot both be awake (gpu_memory 0.55 each), 20
# concurrent requests split between them: all answered 200, no failure, no engine restarted
# (same pids before and after). Then 5-turns (below). Run by matrix.sh with its environment.
set -uo pipefail
source "$D/lib.sh"
proxy_env
control_env
N=20

ready=1
for m in a b; do
    if waitst $m "$START_DEADLINE" asleep; then
        result PASS preload-$m ready_ms="$WAIT_MS" start_ms="$(mget $m calibration.start_ms)" pid="$(mget $m pid)"
    else
        result FAIL preload-$m "$WAIT_LAST" last_error="$(mget $m last_error)"
        ready=0
    fi
done
snap() { # pids, restarts, failures and wake counts of a and b
    local m out=""
    for m in a b; do
        out+="$m:$(mget $m pid)/$(mget $m restarts)/$(mget $m failures) "
    done
    echo "$out"
}
wakes() { echo $(($(mget "$1" calibration.wake_l1_samples) + $(mget "$1" calibration.wake_l2_samples))); }
before=$(snap)
wa=$(wakes a) wb=$(wakes b)
logcmd S placement
t=$(now_ms)
summary=$(python3 "$PY" many "$P/v1/completions" a,b $N $((WAKE_REQ_TIMEOUT * 3)) 2>>"$RUN/detail.txt")
ms=$(($(now_ms) - t))
after=$(snap)
logcmd S status
mem_snapshot
swaps="a:$(($(wakes a) - wa)),b:$(($(wakes b) - wb))"
states="a:$(mget a state),b:$(mget b state)"
ca=$(engine_count a) cb=$(engine_count b)
ok=$ready
case "$summary" in "ok=$N total=$N"*) ;; *) ok=0 ;; esac
[ "$before" = "$after" ] && [ "$ca" = 1 ] && [ "$cb" = 1 ] || ok=0
result "$(verdict $ok)" 5-swap ${summary% text=*} all_ms=$ms wakes=$swaps states=$states api_servers=a:$ca,b:$cb \
    pid/restarts/failures_before="$(echo $before | tr ' ' ,)" after="$(echo $after | tr ' ' ,)"

# Check 5-turns: a kept busy without a pause (4 clients, 256-token answers back to back)
# while b, which needs a's room, is asked twice: a yields its GPU after `yield_after`
# (default 10 s) once b has waited as long; b is answered; every answer of a is whole
# (requests that came during the yield were held and answered on a's next turn); no
# engine restarted.
before=$(snap)
out=$(python3 "$D/../turns" --proxy "${P#http://}" --busy a --waiter b --clients 4 --tokens 256 \
    --asks 2 --gap 6 --api completions --timeout $((WAKE_REQ_TIMEOUT * 3)) 2>>"$RUN/detail.txt")
rc=$?
log "turns: $out"
after=$(snap)
ok=$ready
[ "$rc" = 0 ] && [ "$before" = "$after" ] || ok=0
line=$(echo "$out" | sed -n 's/^summary //p')
result "$(verdict $ok)" 5-turns ${line:-no-summary} exit=$rc \
    yields="$(S logs a 2>/dev/null | grep -c 'yielding its GPUs')" \
    pid/restarts/failures_before="$(echo $before | tr ' ' ,)" after="$(echo $after | tr ' ' ,)"
# Check 7 (tiny's track) kills siesta-control: it waits for this.
flag swap-done
