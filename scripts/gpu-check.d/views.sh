# Section 4 of scripts/gpu-check (sourced): the live views (`siesta top`,
# the web listener's SSE stream, /api/gpus, /metrics) over a real config on
# real GPUs: siesta-control + siesta-proxy + two fake-vllm engines holding
# real GPU memory on GPU 0, one asleep and woken by three requests at once
# through the proxy (held while it wakes).
# GET a URL (no curl needed on the GPU machine).
get() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())' "$1"; }
# Stream a URL to stdout until killed (the SSE stream).
stream() { python3 -u -c '
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=600) as r:
    for line in r:
        sys.stdout.write(line.decode()); sys.stdout.flush()' "$1"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
VDIR=$(mktemp -d)
CTL_PORT=$(free_port); WEB_PORT=$(free_port); PROXY_PORT=$(free_port); ADMIN_PORT=$(free_port)
CTL=http://127.0.0.1:$CTL_PORT
WEB=http://127.0.0.1:$WEB_PORT
VIEW_MEMORY=${GPU_CHECK_VIEW_MEMORY:-$((8 << 30))}
cat >"$VDIR/siesta.toml" <<TOML
[control]
listen = "127.0.0.1:$CTL_PORT"
web_listen = "127.0.0.1:$WEB_PORT"
state_dir = "$VDIR/state"
p2p_probe = "off"

[defaults]
idle = []
max_hold = "120s"
start_timeout = "120s"
wake_timeout = "60s"

[[model]]
name = "chat"
model = "fake/chat"
executable = "$PWD/$BIN/fake-vllm"
gpus = 1
gpu_ids = [0]
gpu_memory = 0.4
preload = "asleep"
args = ["--gpu-memory", "$VIEW_MEMORY", "--wake-time", "3s"]

[[model]]
name = "embed"
model = "fake/embed"
executable = "$PWD/$BIN/fake-vllm"
gpus = 1
gpu_ids = [0]
gpu_memory = 0.3
preload = "awake"
args = ["--gpu-memory", "$((VIEW_MEMORY / 2))", "--runner", "pooling"]
TOML
echo "  config: $VDIR/siesta.toml (chat asleep with $((VIEW_MEMORY >> 20)) MiB, embed awake with $((VIEW_MEMORY >> 21)) MiB, both on GPU 0)"
"$BIN/siesta-control" --config "$VDIR/siesta.toml" --stop-engines-on-exit >"$VDIR/control.log" 2>&1 &
CTL_PID=$!
"$BIN/siesta-proxy" --control "$CTL" --listen "127.0.0.1:$PROXY_PORT" --admin-listen "127.0.0.1:$ADMIN_PORT" >"$VDIR/proxy.log" 2>&1 &
PROXY_PID=$!
views_up=
for _ in $(seq 1 600); do
    st=$("$BIN/siesta" --control "$CTL" status -o json 2>/dev/null)
    if grep -q '"name": *"chat"' <<<"$st" \
        && python3 -c 'import json,sys; m={x["name"]:x["state"] for x in json.load(sys.stdin)["models"]}; sys.exit(0 if m.get("chat")=="asleep" and m.get("embed")=="awake" else 1)' <<<"$st" 2>/dev/null; then
        views_up=1; break
    fi
    sleep 0.5
done
if [ -z "$views_up" ]; then
    fail "views: chat asleep and embed awake not reached"
    tail -n 30 "$VDIR/control.log"
else
    stream "$WEB/events" >"$VDIR/events.txt" 2>&1 &
    SSE_PID=$!
    python3 scripts/gpu-check.d/top-pty.py "$BIN/siesta" "$CTL" 14 "$VDIR/top.raw" "$VDIR/top.ready" >"$VDIR/top.out" 2>&1 &
    TOP_PID=$!
    for _ in $(seq 1 100); do [ -e "$VDIR/top.ready" ] && break; sleep 0.1; done
    sleep 1 # a frame or two of the asleep state on the screen
    python3 - "http://127.0.0.1:$PROXY_PORT" <<'PY' || fail "views: three requests through the proxy"
import json, sys, threading, time, urllib.request
url = sys.argv[1] + "/v1/chat/completions"
res = []
def ask():
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    t = time.monotonic()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        res.append((r.status, time.monotonic() - t))
ts = [threading.Thread(target=ask) for _ in range(3)]
[t.start() for t in ts]; [t.join() for t in ts]
print("  3 requests through the proxy while chat woke:", ", ".join(f"{s} in {d:.2f} s" for s, d in res))
sys.exit(0 if [s for s, _ in res] == [200] * 3 else 1)
PY
    sleep 1
    echo "  GET /api/gpus (the engines' GPU memory from NVML, per process):"
    get "$WEB/api/gpus" | python3 -c '
import json, sys
d = json.load(sys.stdin)
for g in d.get("gpus", []):
    used, total = int(g["memory_used_bytes"]) >> 20, int(g["memory_total_bytes"]) >> 20
    print("    GPU %s %s: used %d MiB of %d MiB" % (g["index"], g.get("name", ""), used, total))
    for p in g.get("processes", []):
        print("      pid %s: %d MiB" % (p["pid"], int(p["used_bytes"]) >> 20))
' | tee "$VDIR/gpus.txt"
    echo "  GET /metrics (engine GPU memory, states):"
    get "$WEB/metrics" | grep -E '^siesta_control_(engine_gpu_memory|model_state\{.*\} 1|gpu_memory_used)' | sed 's/^/    /' | tee "$VDIR/metrics.txt"
    wait "$TOP_PID"; top_rc=$?
    cat "$VDIR/top.out" | sed 's/^/  /'
    kill "$SSE_PID" 2>/dev/null; wait "$SSE_PID" 2>/dev/null
    echo "  SSE /events, chat's model events (state, held):"
    python3 - "$VDIR/events.txt" <<'PY' | tee "$VDIR/events-summary.txt"
import json, sys
seen = []
for line in open(sys.argv[1]):
    if line.startswith("data: "):
        d = json.loads(line[6:])
        m = d.get("model")
        if isinstance(m, dict) and m.get("name") == "chat":
            seen.append((m["state"], m.get("held", 0)))
print("    " + " -> ".join(f"{s}(held {h})" for s, h in seen))
PY
    # What top drew, without its escape sequences (words only).
    python3 -c '
import re, sys
t = open(sys.argv[1], "rb").read().decode("utf-8", "replace")
print(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]", " ", t))' "$VDIR/top.raw" >"$VDIR/top.txt"
    [ "$top_rc" -eq 0 ] && echo "  ok: siesta top ran 14 s and quit on q" || fail "views: siesta top"
    grep -q "waking(held [1-9]" "$VDIR/events-summary.txt" && grep -q "awake(held 0)" "$VDIR/events-summary.txt" \
        && echo "  ok: the SSE stream showed chat waking with held requests, then awake" \
        || fail "views: no waking-with-held then awake on /events"
    words=(chat embed waking awake)
    [ "$NGPUS" -ge 1 ] && words+=("GPU0")
    drew=1
    for w in "${words[@]}"; do
        grep -q "$w" "$VDIR/top.txt" || { fail "views: siesta top never drew \"$w\""; drew=; }
    done
    [ -n "$drew" ] && echo "  ok: siesta top drew: ${words[*]}"
    if [ "$NGPUS" -ge 1 ]; then
        big=$(grep -c 'pid [0-9]*: [0-9]\{4,\} MiB' "$VDIR/gpus.txt")
        [ "$big" -ge 2 ] && echo "  ok: /api/gpus lists both engines' real GPU memory" \
            || fail "views: /api/gpus lists $big engines with GPU memory (want 2)"
        grep -qE 'siesta_control_engine_gpu_memory_bytes\{model="chat",gpu="0"\} [1-9]' "$VDIR/metrics.txt" \
            && echo "  ok: /metrics has chat's engine GPU memory on GPU 0" \
            || fail "views: /metrics has no GPU memory for chat's engine"
    fi
fi
"$BIN/siesta" --control "$CTL" status 2>&1 | sed 's/^/  /'
kill -TERM "$PROXY_PID" "$CTL_PID" 2>/dev/null
wait "$PROXY_PID" "$CTL_PID" 2>/dev/null
# The engines stop with the control plane (--stop-engines-on-exit): one left
# behind would hold GPU memory through the next check (it did: foreign.sh counted
# this check's engines as others' memory).
left=$(pgrep -f "$BIN/fake-vllm" | tr '\n' ' ')
[ -z "$left" ] || { fail "engines left running after the control plane's exit: $left"; pkill -KILL -f "$BIN/fake-vllm"; }
echo "  saved: $VDIR (control.log, proxy.log, events.txt, top.raw, top.txt)"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/views"
    for f in siesta.toml control.log events-summary.txt gpus.txt metrics.txt top.raw top.txt; do
        cp "$VDIR/$f" "$OUT/views/" 2>/dev/null
    done
fi
true
