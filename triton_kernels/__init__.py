"""Triton kernels of fusedist, installed as ``fusedist.triton_kernels``.

This folder is a *source* folder: setup.py maps it to the subpackage
``fusedist.triton_kernels`` (Triton ships a top-level ``triton_kernels`` of its own, which
ours must never shadow). Import it only through ``fusedist``; modules in here use relative
imports. Modules import ``triton`` at import time, so the backend selector
(:mod:`fusedist.backend`) imports them only when the Triton path is chosen.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU tensors;
that is how CI tests them.
"""
