#!/usr/bin/env python3
"""What an engine does with a /wake_up sent while a /sleep?mode=wait drains
its requests (no siesta in between): the premise of siesta's wait for a
draining sleep before every vLLM wake (control/src/engine.rs,
`wait_for_drain`), and of fake-vllm's model of it.

    drain.py EXE MODEL [PORT]     (EXE: vllm or fake-vllm)

Prints INFO lines (what was seen, in order) and one RESULT line.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

exe, model = sys.argv[1], sys.argv[2]
port = int(sys.argv[3]) if len(sys.argv) > 3 else 18123
base = f"http://127.0.0.1:{port}"
T0 = time.time()


def info(what, **kv):
    fields = " ".join(f"{k}={v}" for k, v in kv.items())
    print(f"INFO t={time.time() - T0:.2f}s {what} {fields}", flush=True)


def call(method, path, body=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method)
    if data:
        req.add_header("content-type", "application/json")
    t = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace"), int((time.time() - t) * 1000)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), int((time.time() - t) * 1000)
    except Exception as e:  # noqa: BLE001
        return 0, f"{type(e).__name__}: {e}", int((time.time() - t) * 1000)


def metric(name):
    s, text, _ = call("GET", "/metrics", timeout=5)
    vals = [float(l.split()[-1]) for l in text.splitlines() if l.startswith(name)]
    return max(vals) if s == 200 and vals else None


log = open(os.environ.get("DRAIN_LOG", "/tmp/drain-engine.log"), "w")
env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
argv = [exe, "serve", model, "--port", str(port), "--served-model-name", "m",
        "--enable-sleep-mode", "--enforce-eager", "--gpu-memory-utilization", "0.2"]
engine = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
try:
    for _ in range(600):
        if call("GET", "/health", timeout=2)[0] == 200:
            break
        time.sleep(0.5)
    else:
        print("RESULT engine never healthy")
        sys.exit(1)
    info("ready")
    long = {}

    def generate():
        long["r"] = call("POST", "/v1/completions", {
            "model": "m", "prompt": "hello", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0}, timeout=300)

    gen = threading.Thread(target=generate)
    gen.start()
    for _ in range(100):
        if (metric("vllm:num_requests_running") or 0) >= 1:
            break
        time.sleep(0.1)
    info("running", n=metric("vllm:num_requests_running"))
    slept = {}
    sleeper = threading.Thread(
        target=lambda: slept.setdefault("r", call("POST", "/sleep?level=1&mode=wait", timeout=300)))
    sleeper.start()
    time.sleep(0.5)
    s, t, ms = call("GET", "/is_sleeping", timeout=10)
    info("is_sleeping during the drain", status=s, body=t.strip(), ms=ms,
         sleep_state=metric("vllm:engine_sleep_state"))
    s, t, ms = call("POST", "/wake_up", timeout=120)
    info("wake_up during the drain", status=s, body=t.strip()[:80], ms=ms)
    s, t, _ = call("GET", "/is_sleeping", timeout=10)
    info("is_sleeping after that wake", status=s, body=t.strip())
    gen.join(300)
    s, t, ms = long.get("r", (0, "no answer", 0))
    info("long request", status=s, ms=ms, body=t.strip()[:80])
    sleeper.join(300)
    s, t, ms = slept.get("r", (0, "no answer", 0))
    info("sleep call", status=s, ms=ms, body=t.strip()[:80])
    time.sleep(1)
    s, t, _ = call("GET", "/is_sleeping", timeout=10)
    info("is_sleeping after the drain", status=s, body=t.strip(),
         sleep_state=metric("vllm:engine_sleep_state"))
    s, t, ms = call("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 8},
                    timeout=60)
    info("a request after the drain", status=s, ms=ms, body=t.strip()[:120])
    time.sleep(2)
    health = call("GET", "/health", timeout=5)[0]
    info("after", health=health, engine_alive=engine.poll() is None)
    print(f"RESULT request_after_drain={s} health_after={health} "
          f"engine_alive={engine.poll() is None}", flush=True)
finally:
    try:
        os.killpg(engine.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
