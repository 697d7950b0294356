"""Adapters for training frameworks (optional dependencies).

Each submodule imports its framework; this package imports none of them, so ``import
fusedist`` never pulls in Lightning or anything else optional.
"""
