"""Run a script as one torchrun worker, with the rank's GPU sharing settings applied first.

    torchrun --nproc_per_node=2 -m fusedist.testing.run_rank train.py [args...]

torchrun gives every worker the same environment apart from RANK / LOCAL_RANK, so the
per-rank variables of Note [several ranks on one GPU] (``fusedist/testing/shared_gpu.py``)
are set here, in the worker, before the script runs and before its first NCCL call. With
``FUSEDIST_TEST_RANKS_PER_GPU`` unset the script runs unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys

from .shared_gpu import rank_environment, ranks_per_gpu_setting


def apply(environ=None) -> dict[str, str]:
    """Set this worker's sharing variables in ``environ`` (default ``os.environ``) from its
    RANK / LOCAL_RANK and the setting; returns what was set (nothing when unset)."""
    environ = os.environ if environ is None else environ
    per_gpu = ranks_per_gpu_setting(environ)
    if per_gpu is None:
        return {}
    rank = int(environ.get("RANK", "0"))
    local_rank = int(environ.get("LOCAL_RANK", str(rank)))
    updates = rank_environment(rank, per_gpu, local_rank=local_rank, gpu_count=_gpu_count())
    environ.update(updates)
    return updates


def _gpu_count():
    """Visible GPUs, or None where CUDA is absent (then nothing is checked: a CPU run of the
    launcher is a test of the environment only)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m fusedist.testing.run_rank SCRIPT [ARGS...]")
    apply()
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
