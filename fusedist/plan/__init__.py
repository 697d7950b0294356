"""``fusedist.plan``: memory, communication and step-time planner for data-parallel and ZeRO
training (``python -m fusedist.plan --help``), checked against measured fusedist runs
(``--measure`` under torchrun).

Modules by concern: :mod:`~fusedist.plan.model` (parameter and activation counts),
:mod:`~fusedist.plan.hf_config` (Hugging Face configs),
:mod:`~fusedist.plan.memory`, :mod:`~fusedist.plan.comm`, :mod:`~fusedist.plan.timing`,
:mod:`~fusedist.plan.hardware` (GPU presets), :mod:`~fusedist.plan.suggest`,
:mod:`~fusedist.plan.plan` (one plan), :mod:`~fusedist.plan.report` (the table),
:mod:`~fusedist.plan.measure` (the comparison with a real run), :mod:`~fusedist.plan.cli`.
"""

from .errors import PlanError
from .hardware import PRESETS, Hardware, resolve as resolve_hardware
from .memory import STRATEGIES, model_states
from .hf_config import from_hf_config
from .model import ModelSpec, activation_bytes, active_params, count_params
from .plan import Job, build_plan

__all__ = ["PlanError", "PRESETS", "Hardware", "resolve_hardware", "STRATEGIES", "model_states",
           "ModelSpec", "activation_bytes", "active_params", "count_params", "from_hf_config", "Job", "build_plan"]
