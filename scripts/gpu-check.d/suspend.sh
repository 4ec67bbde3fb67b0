#!/usr/bin/env bash
# The CUDA-suspend tier on a real GPU, in one call (no Rust needed there):
# siesta-control + siesta-proxy + fake-vllm holding 16 GiB of real GPU memory
# (a known pattern) on GPU 0, with an idle tier `suspend` after 15 s.
#   1. the helper alone: its answer for a pid that is not a CUDA process;
#   2. the tier suspends the engine through siesta-cuda-checkpoint: NVML shows
#      its memory gone, host memory takes it;
#   3. a request through the proxy is held, resumes it (restore), answered 200;
#   4. fake-vllm reads every weight byte back and compares it (GET /fake/verify);
#   5. `siesta suspend` then `siesta wake` once more, with the helper's times.
# BIN: the directory holding siesta-control, siesta-proxy, siesta,
# siesta-cuda-checkpoint, siesta-p2p-probe (optional) and fake-vllm (feature cuda).
# Exit status 0 only if every check passed.
set -uo pipefail
BIN=${SIESTA_BIN:-$(cd "$(dirname "$0")" && pwd)}
GPU_MEMORY=${GPU_CHECK_MEMORY:-$((16 << 30))}
failures=()
section() { printf '\n=== %s ===\n' "$*"; }
fail() { echo "FAIL: $*"; failures+=("$*"); }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
get() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=300).read().decode())' "$1"; }
mem_available_mib() { awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo; }
gpu0() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | tr -d ' '; }
apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | sed 's/^/    /'; }

section "machine"
date -u
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 | head -3
echo "  MemAvailable: $(mem_available_mib) MiB"

section "1. siesta-cuda-checkpoint on a pid that is not a CUDA process"
"$BIN/siesta-cuda-checkpoint" state $$; echo "  exit status $?"

D=$(mktemp -d)
CTL_PORT=$(free_port); PROXY_PORT=$(free_port); ADMIN_PORT=$(free_port)
CTL=http://127.0.0.1:$CTL_PORT
PROXY=http://127.0.0.1:$PROXY_PORT
cat >"$D/siesta.toml" <<TOML
[control]
listen = "127.0.0.1:$CTL_PORT"
state_dir = "$D/state"
p2p_probe = "off"
cuda_checkpoint = "$BIN/siesta-cuda-checkpoint"

[defaults]
idle = []
max_hold = "300s"
start_timeout = "180s"
wake_timeout = "120s"

[[model]]
name = "m"
model = "fake/m"
executable = "$BIN/fake-vllm"
gpus = 1
gpu_ids = [0]
gpu_memory = 0.2
preload = "awake"
args = ["--gpu-memory", "$GPU_MEMORY"]
idle = [ { after = "15s", action = "suspend" } ]
TOML
"$BIN/siesta-control" --config "$D/siesta.toml" --stop-engines-on-exit >"$D/control.log" 2>&1 &
CTL_PID=$!
"$BIN/siesta-proxy" --control "$CTL" --listen "127.0.0.1:$PROXY_PORT" --admin-listen "127.0.0.1:$ADMIN_PORT" >"$D/proxy.log" 2>&1 &
PROXY_PID=$!
field() { "$BIN/siesta" --control "$CTL" get m -o json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['model'].get(sys.argv[1], ''))" "$1" 2>/dev/null; }
wait_state() { # state, seconds
    for _ in $(seq 1 $(($2 * 5))); do [ "$(field state)" = "$1" ] && return 0; sleep 0.2; done
    return 1
}

section "2. fake-vllm with $((GPU_MEMORY >> 20)) MiB on GPU 0, suspended by its idle tier"
if ! wait_state awake 180; then
    fail "m never awake"; tail -n 40 "$D/control.log"
else
    PID=$(field pid); URL=$(field endpoints | python3 -c 'import ast,sys; print(ast.literal_eval(sys.stdin.read())[0]["url"])' 2>/dev/null)
    echo "  awake: fake-vllm pid $PID at $URL; GPU 0 used $(gpu0) MiB; MemAvailable $(mem_available_mib) MiB"; apps
    AWAKE_GPU=$(gpu0)
    if wait_state suspended 120; then
        echo "  suspended: GPU 0 used $(gpu0) MiB; MemAvailable $(mem_available_mib) MiB"; apps
        SUSP_GPU=$(gpu0)
        [ $((AWAKE_GPU - SUSP_GPU)) -ge $(((GPU_MEMORY >> 20) * 9 / 10)) ] \
            && echo "  ok: NVML shows the engine's memory gone ($AWAKE_GPU -> $SUSP_GPU MiB)" \
            || fail "GPU 0 went from $AWAKE_GPU to $SUSP_GPU MiB only"
    else
        fail "m never suspended: $(field state) $(field last_error)"
    fi
    echo "  status: $(field state); last_error: $(field last_error)"

    section "3. a request through the proxy resumes it"
    python3 - "$PROXY" <<'PY' || fail "request through the proxy"
import json, sys, time, urllib.request
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
t = time.monotonic()
req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=300) as r:
    print(f"  HTTP {r.status} in {time.monotonic() - t:.2f} s (held through the restore)")
    sys.exit(0 if r.status == 200 else 1)
PY
    echo "  now: $(field state), pid $(field pid) (was $PID), restarts $(field restarts); GPU 0 used $(gpu0) MiB"; apps
    [ "$(field pid)" = "$PID" ] && echo "  ok: the same engine, restored (not restarted)" || fail "the engine was restarted"

    section "4. fake-vllm compares every weight byte with its pattern"
    V=$(get "$URL/fake/verify"); echo "  GET /fake/verify -> $V"
    grep -q '"intact":true' <<<"$V" && echo "  ok: every byte equal after checkpoint and restore" || fail "weights altered after restore"

    section "5. siesta suspend, then siesta wake"
    "$BIN/siesta" --control "$CTL" suspend m 2>&1 | sed 's/^/  /'
    wait_state suspended 120 && echo "  suspended: GPU 0 used $(gpu0) MiB" || fail "siesta suspend: $(field state) $(field last_error)"
    "$BIN/siesta" --control "$CTL" wake m --wait 2>&1 | sed 's/^/  /'
    [ "$(field state)" = awake ] || fail "siesta wake: $(field state) $(field last_error)"
    V=$(get "$URL/fake/verify"); echo "  GET /fake/verify -> $V"
    grep -q '"intact":true' <<<"$V" || fail "weights altered after the second restore"
    echo "  the helper's times (model log):"
    "$BIN/siesta" --control "$CTL" logs m --tail 200 2>&1 | grep -E "suspend|resum|CUDA" | sed 's/^/    /'
    echo "  calibration: $(field calibration)"
fi
"$BIN/siesta" --control "$CTL" status 2>&1 | sed 's/^/  /'
kill -TERM "$PROXY_PID" "$CTL_PID" 2>/dev/null
wait "$PROXY_PID" "$CTL_PID" 2>/dev/null
grep -E "WARN|ERROR" "$D/control.log" | tail -n 20 | sed 's/^/  control: /'
# The engines stop with the control plane (--stop-engines-on-exit): one left
# behind would hold GPU memory through the next check (it did: foreign.sh counted
# this check's engines as others' memory).
left=$(pgrep -f "$BIN/fake-vllm" | tr '\n' ' ')
[ -z "$left" ] || { fail "engines left running after the control plane's exit: $left"; pkill -KILL -f "$BIN/fake-vllm"; }
section "result"
if [ ${#failures[@]} -eq 0 ]; then echo "ALL PASSED"; else printf 'FAILED: %s\n' "${failures[@]}"; exit 1; fi
