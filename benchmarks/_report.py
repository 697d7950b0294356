"""Where benchmark results go: a dated markdown report (+ CSV rows) with the hardware."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _load() -> str:
    try:
        return "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load average unknown"


def hardware_summary() -> str:
    """One line: date, CPU, cores, GPU if any, torch/triton versions, current load."""
    import torch

    parts = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             f"{_cpu_model()}, {os.cpu_count()} cores"]
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    else:
        parts.append("no GPU")
    parts.append(f"torch {torch.__version__}")
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    parts.append(f"Python {platform.python_version()}")
    parts.append(_load())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(RESULTS)).stdout.strip()
        if commit:
            parts.append(f"commit {commit}")
    except OSError:
        pass
    return "; ".join(parts)


def write_report(name: str, title: str, markdown: str, rows: list[dict] | None = None) -> str:
    """Write ``results/<name>-<date>.md`` (and ``.csv`` when rows are given); return the path."""
    os.makedirs(RESULTS, exist_ok=True)
    day = datetime.date.today().isoformat()
    base = os.path.join(RESULTS, f"{name}-{day}")
    with open(base + ".md", "w") as f:
        f.write(f"# {title}\n\n{hardware_summary()}\n\n{markdown}\n")
    if rows:
        with open(base + ".csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return base + ".md"
