#!/usr/bin/env bash
# GPU memory held by a process siesta does not run, on a real GPU (NVML). Run ON the GPU
# machine, from the repo root, with the release `siesta` and `fake-vllm` (feature `cuda`) in
# BIN (default .carry/bin; scripts/gpu-check-build puts them there), in one device call:
#   run(carry=[".carry"], command="bash scripts/gpu-check.d/foreign.sh")
# A torch process (python3 on the GPU machine) is the process siesta does not run; the
# engines are fake-vllm holding real GPU memory, so NVML lists them beside it. GPU 0's size
# is read from NVML; the models' shares are fractions of it.
#   foreign-counted: `a` (0.45) awake holding real memory beside a holder of 0.15: GetPlacement
#     counts the holder's memory as others' (foreign_bytes), not `a`'s engine.
#   foreign-evicts-idle: `a` awake and idle, `b` (0.45) woken: 0.45 + 0.45 + 0.15 > 1, so `a`
#     is put to sleep first and `b` wakes; the holder gone, `a` wakes beside `b` (0.9 fits).
#   foreign-waits-naming-it: the holder takes 0.7, `big` (0.5) is woken: its wake ends after
#     15 s without it, `waiting_for` names the holder's pid; the holder killed, the same
#     wake (still queued) goes ahead and `big` is awake.
# Prints PASS/FAIL lines (also to $OUT/gpu-foreign-output.txt); exit 0 only if all passed.
set -uo pipefail
BIN=$(cd "${SIESTA_BIN:-.carry/bin}" && pwd)
OUT=${OUT:-$(mktemp -d)}
W=$(mktemp -d)
mkdir -p "$OUT"
RES="$OUT/gpu-foreign-output.txt"
: >"$RES"
fails=0
result() {
    echo "$*" | tee -a "$RES"
    [ "$1" = PASS ] || fails=$((fails + 1))
}
log() { echo "  $(date -u +%T) $*"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | tr -d ' ')
[ -n "$TOTAL" ] || TOTAL=81920 # MiB (no NVML here: the checks below fail)
frac_gib() { python3 -c "import sys; print(int(float(sys.argv[1]) * int(sys.argv[2]) / 1024))" "$1" "$TOTAL"; }
log "GPU 0: $TOTAL MiB"

HOLDER=
# hold FRACTION: a torch process takes FRACTION of GPU 0 (until release).
hold() {
    local gib
    gib=$(frac_gib "$1")
    python3 scripts/gpu-hold.py "$gib" 900 >"$W/holder-$1.log" 2>&1 &
    HOLDER=$!
    local end=$((SECONDS + 120))
    until grep -q held "$W/holder-$1.log" 2>/dev/null || ! kill -0 "$HOLDER" 2>/dev/null ||
        [ $SECONDS -ge $end ]; do sleep 0.3; done
    log "holder pid $HOLDER holds $gib GiB: $(tail -1 "$W/holder-$1.log")"
}
release() {
    if [ -n "$HOLDER" ]; then
        kill "$HOLDER" 2>/dev/null
        wait "$HOLDER" 2>/dev/null
    fi
    HOLDER=
}
UP=
cleanup() {
    release
    [ -n "$UP" ] && kill -INT "$UP" 2>/dev/null && wait "$UP" 2>/dev/null
}
trap cleanup EXIT

A_GIB=$(frac_gib 0.44) BIG_GIB=$(frac_gib 0.49)
cat >"$W/siesta.toml" <<TOML
[control]
state_dir = "$W/state"
p2p_probe = "off"
min_awake = "0s"

[defaults]
idle = []
start_timeout = "2m"

TOML
# model NAME SHARE GIB: a fake-vllm engine on GPU 0 holding GIB of real memory awake.
model() {
    cat <<TOML

[[model]]
name = "$1"
model = "fake/$1"
executable = "$BIN/fake-vllm"
gpus = 1
gpu_ids = [0]
gpu_memory = $2
args = ["--gpu-memory", "$(($3 << 30))"]
TOML
}
{
    model a 0.45 "$A_GIB"
    model b 0.45 "$A_GIB"
    model big 0.5 "$BIG_GIB"
} >>"$W/siesta.toml"
"$BIN/siesta" up --config "$W/siesta.toml" --listen 127.0.0.1:0 --control-listen 127.0.0.1:0 \
    --admin-listen 127.0.0.1:0 --addr-file "$W/up.addr" >"$W/up.log" 2>&1 &
UP=$!
for _ in $(seq 1 300); do
    [ -s "$W/up.addr" ] && break
    sleep 0.2
done
GRPC=$(sed -n 's/^grpc=//p' "$W/up.addr")
S() { "$BIN/siesta" --control "http://$GRPC" "$@"; }
# field MODEL KEY: a field of `siesta get MODEL -o json`.
field() { S get "$1" -o json 2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["model"].get(sys.argv[1]) or "")' "$2"; }
# others: GPU 0's foreign_bytes in GiB (GetPlacement).
others() { S placement -o json 2>/dev/null | python3 -c 'import json, sys
g = [g for g in json.load(sys.stdin)["gpus"] if g["index"] == 0]
print(round(g[0]["foreign_bytes"] / 2**30, 1) if g else "none")'; }
# wait_state MODEL STATE SECONDS
wait_state() {
    local end=$((SECONDS + $3))
    until [ "$(field "$1" state)" = "$2" ] || [ $SECONDS -ge $end ]; do sleep 0.3; done
}
log "siesta up: grpc $GRPC"

# 1. counted: the holder's memory, not a's engine's.
S wake a --wait --timeout 2m >/dev/null 2>&1
hold 0.15
want=$(frac_gib 0.15)
# NVML is read again when over a second old: wait for the holder to show.
for _ in $(seq 1 50); do
    got=$(others)
    python3 -c "import sys; sys.exit(0 if abs(float(sys.argv[1]) - float(sys.argv[2])) < 1.5 else 1)" "$got" "$want" 2>/dev/null && break
    sleep 0.2
done
S placement | sed 's/^/    /'
ok=PASS
python3 -c "import sys; sys.exit(0 if abs(float(sys.argv[1]) - float(sys.argv[2])) < 1.5 else 1)" "$got" "$want" 2>/dev/null || ok=FAIL
[ "$(field a state)" = awake ] || ok=FAIL
result $ok foreign-counted others_gib=$got holder_gib=$want a_state=$(field a state) a_holds_gib=$A_GIB

# 2. an idle neighbour is put to sleep for room beside the holder.
out=$(S wake b --wait --timeout 2m 2>&1)
rc=$?
sa=$(field a state) sb=$(field b state)
ok=PASS
[ "$rc" = 0 ] && [ "$sa" = asleep ] && [ "$sb" = awake ] || ok=FAIL
release
out2=$(S wake a --wait --timeout 2m 2>&1)
rc2=$?
sa2=$(field a state) sb2=$(field b state)
[ "$rc2" = 0 ] && [ "$sa2" = awake ] && [ "$sb2" = awake ] || ok=FAIL
result $ok foreign-evicts-idle wake_b_exit=$rc a=$sa b=$sb then_holder_gone_wake_a_exit=$rc2 a=$sa2 b=$sb2
log "wake b: $out"
log "wake a: $out2"

# 3. no room even after sleeping idle models: the wake waits, naming the holder.
S stop a >/dev/null 2>&1
S stop b >/dev/null 2>&1
wait_state a stopped 60
wait_state b stopped 60
hold 0.7
t0=$SECONDS
out=$(S wake big --wait --timeout 15s 2>&1)
rc=$?
state=$(field big state) why=$(field big waiting_for)
log "wake big (15 s): exit $rc: $out"
ok=PASS
[ "$rc" != 0 ] && [ "$state" = starting ] && [[ "$why" == *"processes siesta does not run: pid $HOLDER ("* ]] || ok=FAIL
holder=$HOLDER
release
t1=$SECONDS
out=$(S wake big --wait --timeout 2m 2>&1)
rc2=$?
after=$(field big state)
[ "$rc2" = 0 ] && [ "$after" = awake ] || ok=FAIL
result $ok foreign-waits-naming-it holder_pid=$holder state_while_held=$state waiting_for="$why" \
    started_after_release_s=$((SECONDS - t1)) waited_s=$((t1 - t0)) state_after=$after

cleanup
UP=
log "siesta up's log: $W/up.log"
tail -5 "$W/up.log" | sed 's/^/    /'
echo "# gpu-foreign: $((3 - fails)) passed, $fails failed"
[ "$fails" = 0 ]
