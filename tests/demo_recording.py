"""The demo (examples/train_gpt.py) loaded as a module, with its progress and parameter digest
replaced by recorders: tests run its main() in their own ranks and compare what it trained."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def load_demo(name: str = "train_gpt_under_test"):
    """A fresh module of examples/train_gpt.py (its own globals, so patches do not leak)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, "train_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recording_demo(name: str = "train_gpt_under_test"):
    """``(demo, seen)``: a fresh demo module whose main() records each step's loss in
    ``seen["losses"]`` and its final parameters (fp32 copies, rank 0) in ``seen["state"]``."""
    demo = load_demo(name)
    seen = {"losses": [], "state": None}

    class Recording(demo.Progress):
        def update(self, step, loss, tokens_per_s):
            seen["losses"].append(loss)

    def digest(state):
        seen["state"] = {k: v.detach().float().clone() for k, v in state.items()}
        return "-"

    demo.Progress, demo.parameter_digest = Recording, digest
    return demo, seen
