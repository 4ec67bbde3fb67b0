#!/usr/bin/env bash
# `vllm-check sigterm`: what the clients of an engine see when its process group gets SIGTERM
# (siesta's stop sends it to the group, after the proxies' fence), on real vLLM and (LOCAL)
# on fake-vllm, judged by the same rules, so that the fake's model of a SIGTERM
# (tests/fake-vllm/src/engine/shutdown.rs) is checked against the real engine. No siesta:
# the engine is started and signalled directly (sigterm.py), once with the default
# `--shutdown-timeout` (0) and once with `--shutdown-timeout 20`; in each, one streamed and
# one plain completion of 1,800 tokens are under way at the SIGTERM, and a new request is
# sent every 0.2 s until the server stops answering.
#   sigterm-default: the two under way end early with finish_reason "abort" (200, some text,
#     the stream closed by `data: [DONE]`); new connections are refused within 1 s, and no
#     new request is answered whole meanwhile (vLLM 0.24: one sent at once got 500 "cannot
#     schedule new futures after shutdown"); the whole group gone within 15 s.
#   sigterm-drain: the two under way finish whole ("length"), while new connections are
#     refused from within 1 s of the SIGTERM (no new request answered whole); the whole
#     group gone once they finished, within 20 + 10 s.
# About three minutes on the GPU machine (two starts of vLLM), 30 s LOCAL.
set -uo pipefail
: "${D:?}" "${RUN:?}" "${EXE:?}" "${MODEL:?}" "${LOCAL:?}"
source "$D/lib.sh"
TRACK=sigterm
matrix_begin
T0=$SECONDS
if [ "$LOCAL" = 1 ]; then
    # fake-vllm: as slow as the tiny model on an H200 (about 300 tokens/s per stream).
    ARGS=(--startup-time 1s --tokens-per-second 300)
else
    ARGS=(--gpu-memory-utilization 0.3 --max-model-len 2048 --enforce-eager)
fi
# probe LABEL EXTRA_ARGS...: the probe's JSON in $RUN/sigterm-LABEL.json.
probe() {
    local label=$1
    shift
    log "probe $label: $EXE serve $MODEL ${ARGS[*]} $*"
    python3 "$D/sigterm.py" "$RUN/logs/engine-$label.log" "$EXE" "$MODEL" "${ARGS[@]}" "$@" \
        >"$RUN/sigterm-$label.json" 2>>"$RUN/detail.txt"
    logcmd cat "$RUN/sigterm-$label.json"
}
# judge LABEL CHECK-NAME PYTHON-EXPRESSION: PASS when the expression over the probe's JSON
# (as `r`) holds; the line carries what the clients saw.
judge() {
    python3 - "$RUN/sigterm-$1.json" "$2" "$3" <<'PY'
import json, sys
path, name, rule = sys.argv[1:]
try:
    r = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"FAIL {name} no probe result: {e}")
    sys.exit()
if "error" in r:
    print(f"FAIL {name} {r['error']}")
    sys.exit()
s, p = r.get("stream") or {}, r.get("plain") or {}
ok = False
try:
    ok = bool(eval(rule, {}, {"r": r, "s": s, "p": p}))
except Exception as e:  # noqa: BLE001 - a missing field is a failure
    ok = False
def kv(d, keys):
    return ",".join(f"{k}:{d.get(k)}" for k in keys if k in d)
first = next((a for a in r["after"] if a[1] == "answer"), None)
last = r["after"][-1] if r["after"] else None
print(("PASS" if ok else "FAIL"), name,
      f"stream={kv(s, ['status', 'finish', 'events', 'done', 'error', 's'])}",
      f"plain={kv(p, ['status', 'finish', 'chars', 'error', 's'])}",
      f"new_answered={r['new_answers']} new_whole={r['new_whole']} refused_s={r['refused_s']}",
      f"health_meanwhile={'/'.join(map(str, r['health_during'])) or '-'}",
      f"first_new={json.dumps(first[1:4])[:90] if first else '-'} then={json.dumps(last[1:3]) if last else '-'}@{last[0] if last else '-'}s",
      f"leader_gone_s={r['leader_gone_s']} group_left={len(r['group_left'])} up_s={r['up_s']}")
PY
}
probe default
line=$(judge default sigterm-default \
    "s['status'] == 200 and s['finish'] == 'abort' and s['done'] and p['status'] == 200 and p['finish'] == 'abort' and 0 < p['chars'] and r['new_whole'] == 0 and r['refused_s'] is not None and r['refused_s'] <= 1 and r['leader_gone_s'] is not None and r['leader_gone_s'] <= 15 and not r['group_left']")
result ${line%% *} "${line#* }"
probe drain --shutdown-timeout 20
line=$(judge drain sigterm-drain \
    "s['status'] == 200 and s['finish'] == 'length' and s['done'] and p['status'] == 200 and p['finish'] == 'length' and r['new_whole'] == 0 and r['refused_s'] is not None and r['refused_s'] <= 1 and r['refused_s'] < s['s'] and r['leader_gone_s'] is not None and r['leader_gone_s'] <= 30 and not r['group_left']")
result ${line%% *} "${line#* }"
matrix_end vllm-check-sigterm
