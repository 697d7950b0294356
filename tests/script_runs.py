"""Running several short Python scripts from a test at once: each mostly imports torch, so
started together they cost about as much as one."""

import subprocess
import sys


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
