"""Running several short Python scripts from a test at once: each mostly imports torch, so
started together they cost about as much as one."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional


def run_at_once(scripts: dict, timeout: float = 120, merge_stderr: bool = False) -> dict:
    """``{key: (source, *args)}`` -> ``{key: subprocess.CompletedProcess}``, every script started
    before any is waited for (``python -c source args...``); one still running after ``timeout``
    seconds raises ``subprocess.TimeoutExpired``, and no script is left running."""
    stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    procs = {key: subprocess.Popen([sys.executable, "-c", source, *args], stdout=subprocess.PIPE, stderr=stderr,
                                   text=True) for key, (source, *args) in scripts.items()}
    runs = {}
    try:
        for key, proc in procs.items():
            stdout, err = proc.communicate(timeout=timeout)
            runs[key] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


#: The first lines of a script whose exit path a test reads: it prints "LAST EXIT HANDLER RAN AT <time.time()>"
#: from the exit handler the interpreter runs last, and "INTERPRETER SHUTDOWN RAN" only if the interpreter's
#: own shutdown collects its objects. Put it first: the handler must be registered before any other.
EXIT_MARKERS = r'''
import atexit, os, sys, time

def _last_exit_handler():  # registered first, so the interpreter runs it last
    os.write(1, f"LAST EXIT HANDLER RAN AT {time.time():.3f}\n".encode())

atexit.register(_last_exit_handler)

class _Shutdown:  # collected only by the interpreter's own shutdown
    def __del__(self, write=os.write):  # (os may be gone from the module by then)
        write(1, b"INTERPRETER SHUTDOWN RAN\n")

_shutdown = _Shutdown()
'''


class Ran(NamedTuple):
    """A finished script: its exit status, its output (stderr merged), ``time.time()`` at its end
    (None: it was still running at the launch's timeout, and was killed)."""

    status: int
    output: str
    ended: Optional[float]


def run_ended_at_once(scripts: dict, timeout: float = 150) -> dict:
    """``{key: (source, args, extra environment or None)}`` -> ``{key: Ran}``: every script started
    before any is waited for, each one's end time taken as it ends (polled every 50 ms); one still
    running after ``timeout`` seconds is killed."""
    folder = tempfile.mkdtemp(prefix="fusedist-scripts-")
    procs, ended = {}, {}
    try:
        for n, (key, (source, args, env)) in enumerate(scripts.items()):
            out = open(os.path.join(folder, f"{n}.out"), "w+")
            procs[key] = (subprocess.Popen([sys.executable, "-c", source, *args], stdout=out,
                                           stderr=subprocess.STDOUT,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}), out)
        deadline = time.monotonic() + timeout
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for key, (proc, _) in procs.items():
                if key not in ended and proc.poll() is not None:
                    ended[key] = time.time()
            time.sleep(0.05)
    finally:
        runs = {}
        for key, (proc, out) in procs.items():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            out.seek(0)
            runs[key] = Ran(proc.returncode, out.read(), ended.get(key))
            out.close()
        shutil.rmtree(folder, ignore_errors=True)
    return runs
