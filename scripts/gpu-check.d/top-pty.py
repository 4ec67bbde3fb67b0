"""Runs `siesta --control URL top` in a pseudo-terminal of 40 x 120 for a
while, then presses q. Writes everything it drew to OUT; prints the exit
status. Usage: top-pty.py SIESTA URL SECONDS OUT READY_FILE
(the pty's output starts being kept at once; READY_FILE is created once the
first frame arrived, so the caller knows top is up)."""
import fcntl, os, pty, select, struct, sys, termios, time

siesta, url, secs, out, ready = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5]
pid, fd = pty.fork()
if pid == 0:
    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    os.environ["TERM"] = "xterm-256color"
    os.execv(siesta, [siesta, "--control", url, "top"])
buf = b""
end = time.time() + secs
while time.time() < end:
    r, _, _ = select.select([fd], [], [], 0.1)
    if r:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        if not buf:
            open(ready, "w").close()
        buf += chunk
os.write(fd, b"q")
end = time.time() + 10
status = None
while time.time() < end:
    done, st = os.waitpid(pid, os.WNOHANG)
    if done:
        status = st
        break
    r, _, _ = select.select([fd], [], [], 0.1)
    if r:
        try:
            buf += os.read(fd, 65536)
        except OSError:
            pass
if status is None:
    os.kill(pid, 9)
    print("top did not exit on q")
    sys.exit(1)
open(out, "wb").write(buf)
print(f"top exited with status {os.waitstatus_to_exitcode(status)} after q; {len(buf)} bytes drawn")
sys.exit(0 if os.waitstatus_to_exitcode(status) == 0 else 1)
