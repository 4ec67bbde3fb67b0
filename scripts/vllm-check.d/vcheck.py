# Helpers for scripts/vllm-check (python3 standard library only: it runs on the GPU machine
# with no network and on the development machine). Named vcheck.py: a helper named http.py
# would shadow Python's own `http` package.
#
#   req METHOD URL [BODY] [TIMEOUT_S]
#       one line: STATUS MS RETRY_AFTER TEXT_JSON   (STATUS 000 on a connection error;
#       TEXT_JSON: the completion's text, else the error message, JSON-encoded)
#   many URL MODELS N [TIMEOUT_S]
#       N completions at once, spread over the comma-separated MODELS in turn; one line:
#       ok=K total=N max_ms=.. p50_ms=.. per_model=a:5/5,b:5/5 statuses=200:20 distinct_texts=D
#       text=FIRST_OK_TEXT_JSON
#   stream URL MODEL TOKENS MARK [TIMEOUT_S]
#       one streamed completion of TOKENS tokens (ignore_eos); touches the file MARK when
#       the first event arrives; one line: status=.. events=N done=yes|no finish=REASON ms=..
#       error=.. (`done`: the stream ended with `data: [DONE]`, no in-stream error; `finish`:
#       the last finish_reason, `length` once all TOKENS were generated; vLLM may carry more
#       than one token in an event, so N can be below TOKENS)
#   hangup URL MODEL TOKENS ENGINE_URL [DEADLINE_S]
#       two completions of TOKENS tokens at once (one streamed, one not), the clients hang up
#       once the stream's first event has come and the engine counts both running; then polls
#       ENGINE_URL/metrics until `vllm:num_requests_running` is 0; one line:
#       running_during=N running_after=M freed_ms=.. events_before=E
#       (freed_ms: from the hang-up to the gauge at 0; -1 if it never got there by DEADLINE_S)
#   get JSON_PATH...         reads JSON on stdin, prints the values at a.b.0.c (empty if absent),
#                            separated by spaces
#   wait SIESTA MODEL DEADLINE_S TARGET...
#       polls `SIESTA get MODEL -o json` until each TARGET (state or state:level, e.g.
#       asleep:1; `|` between alternatives) is seen, in order; one line per target:
#       `TARGET ELAPSED_MS`, or `TIMEOUT TARGET last=STATE:LEVEL` and exit 1
#   engines [SCOPE]          every process carrying SIESTA_ENGINE_TAG (an engine siesta spawned,
#                            its engine core and workers): PID PGID PPID COMM MODEL (from the tag);
#                            with SCOPE, only those whose stdout or stderr is a file under SCOPE
#                            (siesta's state_dir/logs), not other siesta instances' engines
#   environ PID              the engine-relevant variables of /proc/PID/environ, one line
#   p2p GPUS_JSON            the P2P verdicts of `siesta gpus -o json`: 0->1:ok,1->0:ok (or none)
#   residual PLACEMENT_JSON STATUS_JSON GPU
#       siesta's asleep residual on GPU: `placement.gpus[GPU].asleep_bytes` / the models asleep
#       there (from `siesta status -o json`), in MiB: RESIDUAL_MIB ASLEEP_BYTES N_ASLEEP
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def completion_text(body):
    try:
        d = json.loads(body)
    except ValueError:
        return body[:300]
    if isinstance(d, dict) and d.get("choices"):
        c = d["choices"][0]
        if "text" in c:
            return c["text"]
        return (c.get("message") or {}).get("content") or ""
    if isinstance(d, dict) and isinstance(d.get("error"), dict):
        return "ERROR: " + str(d["error"].get("message", ""))[:300]
    return body[:300]


def request(method, url, body=None, timeout=120.0):
    """(status, ms, retry_after, text)"""
    data = body.encode() if body else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode(errors="replace")
            return r.status, (time.monotonic() - t) * 1000, "-", completion_text(text)
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        ra = e.headers.get("Retry-After") or "-"
        return e.code, (time.monotonic() - t) * 1000, ra, completion_text(text)
    except Exception as e:  # connection refused, timeout, reset
        return 0, (time.monotonic() - t) * 1000, "-", f"{type(e).__name__}: {e}"


def cmd_req(args):
    method, url = args[0], args[1]
    body = args[2] if len(args) > 2 and args[2] else None
    timeout = float(args[3]) if len(args) > 3 else 120.0
    st, ms, ra, text = request(method, url, body, timeout)
    print(f"{st:03d} {ms:.0f} {ra} {json.dumps(text)}", flush=True)


def cmd_many(args):
    url, models, n = args[0], args[1].split(","), int(args[2])
    timeout = float(args[3]) if len(args) > 3 else 300.0
    results = [None] * n

    def one(i):
        m = models[i % len(models)]
        body = json.dumps({"model": m, "prompt": "hello world the model is",
                           "max_tokens": 12, "temperature": 0})
        results[i] = (m,) + request("POST", url, body, timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (m, st, ms, ra, text) in enumerate(results):
        print(f"  request {i} model={m} status={st} ms={ms:.0f} retry_after={ra} "
              f"text={json.dumps(text)}", file=sys.stderr)
    ok = [r for r in results if r[1] == 200]
    lat = sorted(r[2] for r in results)
    per = ",".join(f"{m}:{sum(1 for r in ok if r[0] == m)}/{sum(1 for r in results if r[0] == m)}"
                   for m in models)
    statuses = {}
    for r in results:
        statuses[r[1]] = statuses.get(r[1], 0) + 1
    sts = ",".join(f"{k}:{v}" for k, v in sorted(statuses.items()))
    texts = len({(r[0], r[4]) for r in ok})
    first = json.dumps(ok[0][4]) if ok else '""'
    print(f"ok={len(ok)} total={n} max_ms={lat[-1]:.0f} p50_ms={lat[len(lat) // 2]:.0f} "
          f"per_model={per} statuses={sts} distinct_texts={texts} text={first}")


def dig(value, path):
    for part in path.split(".") if path else []:
        if isinstance(value, list):
            try:
                value = value[int(part)]
            except (ValueError, IndexError):
                return None
        elif isinstance(value, dict):
            value = value.get(part)
        else:
            return None
    return value


def show(v):
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def cmd_stream(args):
    url, model, tokens, mark = args[0], args[1], int(args[2]), args[3]
    timeout = float(args[4]) if len(args) > 4 else 120.0
    body = json.dumps({"model": model, "prompt": "hello world the model is", "stream": True,
                       "max_tokens": tokens, "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t = time.monotonic()
    status, events, done, error, finish = 0, 0, False, "", "-"
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status = r.status
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                if events == 0:
                    open(mark, "w").close()
                if '"error"' in data:
                    error = data[:200]
                try:
                    finish = json.loads(data)["choices"][0].get("finish_reason") or finish
                except (ValueError, KeyError, IndexError, TypeError):
                    pass
                events += 1
    except urllib.error.HTTPError as e:
        status, error = e.code, e.read().decode(errors="replace")[:200]
    except Exception as e:  # connection reset, timeout
        error = f"{type(e).__name__}: {e}"
    ok = done and not error
    print(f"status={status} events={events} done={'yes' if ok else 'no'} finish={finish} "
          f"ms={(time.monotonic() - t) * 1000:.0f} error={json.dumps(error)}", flush=True)


def running(engine_url):
    """The engine's `vllm:num_requests_running`, summed over its label sets."""
    try:
        with urllib.request.urlopen(engine_url + "/metrics", timeout=10) as r:
            text = r.read().decode(errors="replace")
    except Exception:  # noqa: BLE001 - an engine that does not answer counts as unknown
        return -1
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running")))


def cmd_hangup(args):
    import http.client
    import socket
    from urllib.parse import urlsplit

    url, model, tokens, engine = args[0], args[1], int(args[2]), args[3]
    deadline = float(args[4]) if len(args) > 4 else 30.0
    u = urlsplit(url)
    conns = []
    for stream in (True, False):
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=deadline)
        c.request("POST", u.path, json.dumps({
            "model": model, "prompt": "hello world the model is", "stream": stream,
            "max_tokens": tokens, "ignore_eos": True, "temperature": 0}),
            {"Content-Type": "application/json"})
        conns.append(c)
    # The stream's headers and first event: its request is running.
    r = conns[0].getresponse()
    events = 0
    while events == 0:
        line = r.fp.readline()
        if not line:
            break
        events += line.startswith(b"data:")
    end = time.monotonic() + deadline
    during = running(engine)
    while during < 2 and time.monotonic() < end:
        time.sleep(0.05)
        during = running(engine)
    t = time.monotonic()
    for c in conns:  # hang up: both sockets closed, nothing more read
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
    after, freed = during, -1
    while time.monotonic() < t + deadline:
        after = running(engine)
        if after == 0:
            freed = (time.monotonic() - t) * 1000
            break
        time.sleep(0.05)
    print(f"running_during={during} running_after={after} freed_ms={freed:.0f} "
          f"events_before={events}", flush=True)


def cmd_get(args):
    try:
        d = json.load(sys.stdin)
    except ValueError:
        d = None
    print(" ".join(show(dig(d, p)) for p in args))


def model_state(siesta, model):
    try:
        out = subprocess.run([siesta, "get", model, "-o", "json"], capture_output=True,
                             text=True, timeout=10).stdout
        m = json.loads(out)["model"]
        return m["state"], int(m.get("sleep_level") or 0)
    except Exception:
        return "unreachable", 0


def matches(target, state, level):
    for alt in target.split("|"):
        s, _, lv = alt.partition(":")
        if s == state and (not lv or int(lv) == level):
            return True
    return False


def cmd_wait(args):
    siesta, model, deadline = args[0], args[1], float(args[2])
    t0 = time.monotonic()
    state, level = "unknown", 0
    for target in args[3:]:
        while True:
            state, level = model_state(siesta, model)
            if matches(target, state, level):
                print(f"{target} {(time.monotonic() - t0) * 1000:.0f}", flush=True)
                break
            if time.monotonic() - t0 > deadline:
                print(f"TIMEOUT {target} last={state}:{level}", flush=True)
                sys.exit(1)
            time.sleep(0.1)


def read_environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def in_scope(pid, scope):
    for fd in (1, 2):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(scope):
                return True
        except OSError:
            pass
    return False


def cmd_engines(args):
    scope = args[0] if args else None
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        env = read_environ(name)
        if not env or "SIESTA_ENGINE_TAG" not in env:
            continue
        if scope and not in_scope(name, scope):
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            # The tag is CONTROL_ID/MODEL/GENERATION/RANDOM (control/src/runner/effects.rs).
            parts = env["SIESTA_ENGINE_TAG"].rsplit("/", 3)
            model = parts[1] if len(parts) == 4 else "-"
            print(name, fields[2], fields[1], comm.replace(" ", "_"), model)
        except (OSError, ValueError, IndexError):
            continue


def cmd_environ(args):
    env = read_environ(args[0])
    if env is None:
        print("gone")
        return
    keep = sorted(k for k in env if k.startswith(("NCCL_", "CUDA_", "TORCH_", "NVSHMEM_"))
                  or k in ("VLLM_SERVER_DEV_MODE", "SIESTA_ENGINE_TAG"))
    print(" ".join(f"{k}={env[k]}" for k in keep))


def cmd_p2p(args):
    with open(args[0]) as f:
        d = json.load(f)
    pairs = [f"{p['src']}->{p['dst']}:{p['health']}" for p in d.get("p2p", [])]
    print(",".join(pairs) or "none")


def cmd_residual(args):
    with open(args[0]) as f:
        placement = json.load(f)
    with open(args[1]) as f:
        status = json.load(f)
    gpu = int(args[2])
    asleep = sum(1 for m in status.get("models", [])
                 if m.get("state") == "asleep" and gpu in (m.get("gpus") or []))
    b = next((g.get("asleep_bytes", 0) for g in placement.get("gpus", [])
              if g.get("index") == gpu), 0)
    per = b / asleep / 2**20 if asleep else 0
    print(f"{per:.0f} {b} {asleep}")


if __name__ == "__main__":
    cmds = {"req": cmd_req, "many": cmd_many, "stream": cmd_stream, "hangup": cmd_hangup, "get": cmd_get, "wait": cmd_wait,
            "engines": cmd_engines, "environ": cmd_environ, "residual": cmd_residual, "p2p": cmd_p2p}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        sys.exit(f"usage: vcheck.py {{{'|'.join(cmds)}}} ARGS... (see the header)")
    cmds[sys.argv[1]](sys.argv[2:])
