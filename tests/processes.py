"""Starts several Python processes on this machine and waits for them all,
for the multi-process tests: free localhost ports chosen at run time, each
process's output in a file (a full pipe would block it), and every process
killed, by its process group, as soon as one fails or the time is up, so a
dead peer never hangs the suite.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_ports(count=1):
    """`count` different localhost TCP ports nothing listens on now."""
    probes = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("localhost", 0))  # held open together: no port twice
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def run(commands, env=None, timeout=300.0):
    """Runs each command (argument lists for `python -m`, from the
    repository root) in a process of its own, with `env` added to this
    process's environment (a dict, or one dict per command). Returns one
    `(returncode, stdout, stderr)` per command; a process still running when
    another failed, or at `timeout` seconds, is killed (returncode < 0)."""
    envs = env if isinstance(env, list) else [env or {}] * len(commands)
    with tempfile.TemporaryDirectory() as folder:
        started = []
        deadline = time.monotonic() + timeout
        try:
            for i, (command, extra) in enumerate(zip(commands, envs)):
                out, err = (open(os.path.join(folder, f"{i}.{kind}"), "w+") for kind in ("out", "err"))
                process = subprocess.Popen(
                    [sys.executable, "-m", *command],
                    cwd=ROOT,
                    env={**os.environ, **extra},
                    stdout=out,
                    stderr=err,
                    text=True,
                    start_new_session=True,
                )
                started.append((process, out, err))
            while any(p.poll() is None for p, _, _ in started):
                if any(p.poll() not in (None, 0) for p, _, _ in started) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for process, _, _ in started:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        results = []
        for process, out, err in started:
            out.seek(0)
            err.seek(0)
            results.append((process.returncode, out.read(), err.read()))
            out.close()
            err.close()
        return results
