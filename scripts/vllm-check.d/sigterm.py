# `vllm-check sigterm`'s probe (python3 standard library only): what the clients of one
# engine see when its process group gets SIGTERM, as siesta's stop sends it.
#
#   sigterm.py LOG EXE MODEL [ENGINE_ARGS...]
#
# Starts `EXE serve MODEL --port P ENGINE_ARGS...` in its own process group (output to LOG),
# waits for /health 200 (deadline 6 min), starts one streamed and one plain chat completion
# of 1,800 tokens (ignore_eos), and once the stream has produced its first event sends
# SIGTERM to the group. Then, every 0.2 s until the server stops answering (at most 60 s), a
# new 5-token completion and a GET /health. Prints one JSON object:
#   up_s, stream {status, events, finish, done, error, s}, plain {status, finish, chars,
#   error, s}, after [[seconds after SIGTERM, what, health status] for each change],
#   new_answers (how many answers the new requests got), new_whole (how many of them were
#   200 and not aborted), refused_s (when a new request was first refused: the server
#   stopped accepting), health_during (the /health statuses seen while new requests were
#   answered),
#   leader_gone_s (when the group leader was reaped), group_left (live pids of the group
#   left 10 s after that; all are killed then).
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import http.client

TOKENS = 1800


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def body(n, stream):
    return json.dumps({"model": "probe", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": n, "ignore_eos": True, "temperature": 0,
                       "stream": stream})


def conn(port, timeout):
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


def post(port, tokens, stream, timeout):
    """Sends one chat completion; its response (headers read)."""
    c = conn(port, timeout)
    c.request("POST", "/v1/chat/completions", body(tokens, stream),
              {"content-type": "application/json"})
    return c.getresponse()


def streamer(port, out, first):
    t = time.time()
    try:
        r = post(port, TOKENS, True, 120)
        data = b""
        while True:
            ch = r.read1(65536)
            if not ch:
                break
            data += ch
            if b"data: " in data:
                first.set()
        lines = [ln for ln in data.decode(errors="replace").split("\n") if ln.startswith("data: ")]
        finish = None
        for ln in lines:
            try:
                d = json.loads(ln[6:])
            except ValueError:
                continue
            for ch in d.get("choices") or []:
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
            if "error" in d:
                finish = "error: " + str(d["error"])[:120]
        out["stream"] = dict(status=r.status, events=len(lines), finish=finish,
                             done=bool(lines) and lines[-1].strip() == "data: [DONE]",
                             s=round(time.time() - t, 2))
    except Exception as e:  # noqa: BLE001 - what the client saw is the result
        out["stream"] = dict(error=f"{type(e).__name__}: {e}", s=round(time.time() - t, 2))
    first.set()


def plain(port, out):
    t = time.time()
    try:
        r = post(port, TOKENS, False, 120)
        d = r.read().decode(errors="replace")
        try:
            ch = json.loads(d)["choices"][0]
            out["plain"] = dict(status=r.status, finish=ch.get("finish_reason"),
                                chars=len(ch["message"]["content"] or ""),
                                s=round(time.time() - t, 2))
        except (ValueError, KeyError, IndexError, TypeError):
            out["plain"] = dict(status=r.status, body=d[:160], s=round(time.time() - t, 2))
    except Exception as e:  # noqa: BLE001
        out["plain"] = dict(error=f"{type(e).__name__}: {e}", s=round(time.time() - t, 2))


def new_request(port):
    """One short completion: ('answer', status, finish, text) or ('error', msg)."""
    try:
        r = post(port, 5, False, 10)
        d = r.read().decode(errors="replace")
        try:
            ch = json.loads(d)["choices"][0]
            return ("answer", r.status, ch.get("finish_reason"), ch["message"]["content"] or "")
        except (ValueError, KeyError, IndexError, TypeError):
            return ("answer", r.status, None, d[:120])
    except Exception as e:  # noqa: BLE001
        return ("error", f"{type(e).__name__}")


def health(port):
    try:
        c = conn(port, 5)
        c.request("GET", "/health")
        return c.getresponse().status
    except Exception:  # noqa: BLE001
        return None


def group_pids(pgid):
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if st[0] != "Z" and int(st[2]) == pgid:
            pids.append(int(d))
    return pids


def main():
    log, exe, model, *args = sys.argv[1:]
    port = free_port()
    with open(log, "w") as f:
        proc = subprocess.Popen([exe, "serve", model, "--port", str(port),
                                 "--served-model-name", "probe", *args],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    res = {}
    t0 = time.time()
    while health(port) != 200:
        if proc.poll() is not None or time.time() - t0 > 360:
            res["error"] = f"not up: exit {proc.poll()} after {round(time.time() - t0)} s"
            print(json.dumps(res))
            proc.kill()
            return
        time.sleep(0.5)
    res["up_s"] = round(time.time() - t0, 1)
    out, first = {}, threading.Event()
    ts = [threading.Thread(target=streamer, args=(port, out, first)),
          threading.Thread(target=plain, args=(port, out))]
    for t in ts:
        t.start()
    first.wait(60)
    time.sleep(0.3)
    t_sig = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    after, answers, whole, refused, health_during = [], 0, 0, None, set()
    while time.time() - t_sig < 60:
        t = time.time()
        what = new_request(port)
        hs = health(port)
        if what[0] == "answer":
            answers += 1
            whole += what[1] == 200 and what[2] != "abort"
            health_during.add(hs)
        elif refused is None:
            refused = round(t - t_sig, 2)
        key = list(what) + [hs]
        if not after or after[-1][1:] != key:
            after.append([round(t - t_sig, 2)] + key)
        if what[0] == "error":
            break
        time.sleep(0.2)
    for t in ts:
        t.join(90)
    try:
        proc.wait(timeout=max(1, 60 - (time.time() - t_sig)))
        res["leader_gone_s"] = round(time.time() - t_sig, 2)
    except subprocess.TimeoutExpired:
        res["leader_gone_s"] = None
    end = time.time() + 10
    while group_pids(proc.pid) and time.time() < end:
        time.sleep(0.1)
    left = group_pids(proc.pid)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    if res["leader_gone_s"] is None:
        proc.kill()
        proc.wait()
    res.update(stream=out.get("stream"), plain=out.get("plain"), after=after,
               new_answers=answers, new_whole=whole, refused_s=refused,
               health_during=sorted(h for h in health_during if h is not None),
               group_left=left)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
