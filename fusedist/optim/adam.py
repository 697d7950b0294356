"""FusedAdam and FusedAdamW: torch.optim.Adam/AdamW semantics, one multi-tensor launch per
dtype bucket, optional FP32 master weights, and the fused GradScaler protocol."""

from __future__ import annotations

import torch

from . import functional
from ._base import FusedOptimizerBase, masters_of, state_values
from ._hyperparameters import check_finite_hyper, check_not_text, check_tensor_betas, hyper_number, lr_value


class FusedAdam(FusedOptimizerBase):
    """Drop-in for ``torch.optim.Adam`` (L2 weight decay added to the gradient).

    Constructor keywords are torch's, plus ``master_weights``: with True, bf16/fp16
    parameters get an FP32 copy in ``state["master_param"]``; the update runs on it and the
    parameter receives its rounded value, so the low-precision weights follow the FP32
    trajectory. Optimizer states (``exp_avg``, ``exp_avg_sq``) are FP32 for every parameter
    dtype (fp64 for fp64 parameters). ``decoupled_weight_decay=True`` gives AdamW, as in
    torch. ``amsgrad=True`` keeps torch's ``max_exp_avg_sq`` state (fp32) and runs in the same
    fused pass on the GPU (on the CPU it takes the PyTorch path: the C++ kernel has no
    AMSGrad). ``capturable`` and ``differentiable`` are not supported (True raises; a group
    loaded or added with ``differentiable=True`` steps as torch's: Note [a differentiable group]);
    ``foreach``/``fused`` are accepted as hints (``fused=False`` raises, and both True
    as in torch). A state dict saved with ``capturable=True`` loads, and its groups keep the
    flag, as torch's Adam loads one (Note [a capturable state dict]).

    Two things torch's Adam refuses are taken, with torch's numerics where it has them: a
    gradient of another floating dtype than its parameter (its ``grad_dtype`` lifted, e.g. fp32
    gradients of bf16 weights) steps as torch's step on the gradient converted to the compute
    dtype (fp32; fp64 for fp64 parameters), where torch's raises "expected dtype float for
    `end`"; and ``amsgrad`` switched on after a parameter's state was made starts its
    ``max_exp_avg_sq`` at zeros -- torch's AMSGrad from that step on -- where torch's raises
    ``KeyError: 'max_exp_avg_sq'`` (tests/test_optim_gradient_dtypes_sparse_and_late_amsgrad.py).
    """

    # ZeRO's slices and fully_shard's pieces may be stepped (Note [elementwise optimizers
    # only] in elementwise.py).
    _fusedist_elementwise = True
    _takes_complex = True  # Note [complex parameters] in _complex.py

    _state_keys = ("exp_avg", "exp_avg_sq")
    _adamw = False
    _torch_counterpart = torch.optim.Adam
    _own_group_defaults = {"master_weights": False, "bias_correction": True}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None, amsgrad=False,
                 *, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, master_weights=False, bias_correction=True):
        if weight_decay is None:
            weight_decay = 1e-2 if self._adamw else 0  # (torch.optim.Adam's default, an int)
        name = type(self).__name__
        for flag, value in (("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError(f"{name}: {flag}=True is not supported")
        if fused is False:
            raise ValueError(f"{name}: fused=False asks for torch's unfused implementation; use torch.optim instead")
        if fused and foreach:  # (torch's refusal: the two name different implementations)
            raise RuntimeError(f"{name}: `fused` and `foreach` cannot be `True` together.")
        if isinstance(lr, torch.Tensor) and foreach:  # Note [a tensor learning rate]
            raise ValueError(f"{name}: lr as a Tensor is not supported for capturable=False and foreach=True")
        betas = check_tensor_betas(name, tuple(betas), foreach)  # torch's rules, read as numbers at each step
        # ``foreach`` only picks between torch's implementations (same math): accepted as a
        # hint for drop-in compatibility; this optimizer is always multi-tensor and fused.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad),
                        maximize=maximize, master_weights=master_weights, bias_correction=bias_correction,
                        decoupled_weight_decay=bool(decoupled_weight_decay) or self._adamw,
                        foreach=foreach, fused=fused)  # kept as torch keeps them (its keys)
        super().__init__(params, defaults)

    def _validate_group(self, group, index):
        name = f"{type(self).__name__} (param group {index})"
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        self._check_lr(name, lr)
        check_finite_hyper(name, eps=eps, weight_decay=wd)
        for beta in group["betas"]:  # (a string passed the float() below)
            check_not_text(name, "betas", beta)
        if self._reads_betas(group["betas"]):  # (tensors too, as torch's: Note [betas on the device])
            beta1, beta2 = (lr_value(b) for b in group["betas"])
            check_finite_hyper(name, betas=(beta1, beta2))
            if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
                raise ValueError(f"{name}: invalid betas {(beta1, beta2)} (each must be in [0, 1))")
        if eps < 0:
            raise ValueError(f"{name}: invalid epsilon {eps}")
        if wd < 0:
            raise ValueError(f"{name}: invalid weight_decay {wd}")
        # (a group's ``capturable``, loaded or added, is kept and read by nothing: Note [a capturable state dict])

    # Note [a capturable state dict]
    # torch's Adam/AdamW made with ``capturable=True`` (to capture the step in a CUDA graph) save it
    # in their param groups, with each step count an fp32 tensor on the parameter's device. torch's
    # non-capturable optimizers load such a state dict -- the loaded groups keep the flag, the step
    # counts go to the parameters' device -- and this optimizer refused it, so a run resumed with
    # the fused drop-in from a checkpoint of a CUDA-graph run needed the file edited. The flag says
    # how the saving optimizer ran its step, not what it computes, and the fused step already keeps
    # its step counts where a capturable one does (fp32 tensors on the parameters' device), so the
    # state loads as torch's does: the flag kept in the groups, so that a state dict saved again
    # gives it back to a torch optimizer, and changing nothing in the fused step. The
    # constructor still refuses ``capturable=True``: a request for a step that can be captured in
    # a CUDA graph, which the fused step does not promise.

    def _reads_betas(self, betas) -> bool:
        """Whether validation reads the betas' values: always for numbers and host tensors;
        tensors on an accelerator outside ``step()`` only (at construction and load, as a
        tensor lr: reading them in the step would wait for the device)."""
        on_device = any(isinstance(b, torch.Tensor) and b.device.type != "cpu" for b in betas)
        return not (on_device and self._fusedist_in_step)

    def _collect_group(self, group, gi):
        """torch's step-time refusals of a tensor lr in a ``foreach`` group (Note [a tensor
        learning rate]) and of a differentiable group run ``foreach``/``fused`` (Note [a
        differentiable group]), before anything is written."""
        if group.get("foreach") and isinstance(group["lr"], torch.Tensor):
            raise RuntimeError(f"{type(self).__name__} (param group {gi}): lr as a Tensor is not supported "
                               "for capturable=False and foreach=True")
        collected = super()._collect_group(group, gi)
        implementation = next((k for k in ("fused", "foreach") if group.get(k)), None)
        if group.get("differentiable") and implementation and collected[0]:
            raise RuntimeError(
                f"{type(self).__name__} (param group {gi}): the group has differentiable=True and "
                f"{implementation}=True, which torch's {self._torch_counterpart.__name__} refuses at its step "
                f"(its {implementation} implementation has no differentiable form); nothing was updated. Set the "
                f"group's {implementation} to None (or differentiable to False: the step runs without "
                "autograd either way, as torch's does)")
        return collected

    # Note [a differentiable group]
    # torch's optimizers record ``differentiable`` in every group, and a group loaded from a state
    # dict or added with ``add_param_group`` may say True while the optimizer was built without it.
    # torch's step then still runs without autograd (it enables gradients by the optimizer's
    # defaults, not by the group) and computes the ordinary update; the group keeps the flag, and a
    # state dict saved again gives it back. The fused step does the same. What torch refuses of
    # such a group is refused here too, before any group is stepped (torch raises in that group's
    # step, after the groups before it were updated): Adam/AdamW with ``foreach=True``
    # (AssertionError "_foreach ops don't support autograd") or ``fused=True`` ("Adam with
    # fused=True does not support differentiable=True"). The constructor refuses
    # ``differentiable=True``: a request for a step that autograd records, which the fused step
    # does not give.

    def _init_state(self, group, p, state):
        super()._init_state(group, p, state)
        if group.get("amsgrad") and state.get("max_exp_avg_sq") is None:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"], memory_format=torch.preserve_format)

    def _decoupled(self, group) -> bool:
        """Whether ``group`` takes AdamW's decoupled weight decay: its own setting, as torch's
        Adam and AdamW read it per group (a group added with ``decoupled_weight_decay=False``
        to an AdamW takes L2 decay in torch's step too)."""
        return bool(group.get("decoupled_weight_decay", self._adamw))

    def __setstate__(self, state: dict) -> None:
        """torch's Adam: a loaded group without the key (saved before torch had it) is Adam's
        L2 decay, whatever this optimizer was built with (torch's ``load_state_dict`` passes
        the loaded groups through here)."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", self._adamw)

    def _step_group(self, group, params, grads, states, *, inv_scale, clip_coef, found_inf):
        beta1, beta2 = group["betas"]  # tensors are read by the kernels (Note [betas on the device])
        max_exp_avg_sqs = None
        if group.get("amsgrad"):
            for p, s in zip(params, states):  # amsgrad may be switched on after the state was made
                if "max_exp_avg_sq" not in s:
                    self._init_state(group, p, s)
            max_exp_avg_sqs = state_values(states, "max_exp_avg_sq")
        functional.adam_update(
            params, grads, state_values(states, "exp_avg"), state_values(states, "exp_avg_sq"),
            masters_of(states), lr=group["lr"], beta1=beta1, beta2=beta2, eps=hyper_number(group["eps"]),
            weight_decay=hyper_number(group["weight_decay"]), adamw=self._decoupled(group),
            step=state_values(states, "step"),
            bias_correction=group.get("bias_correction", True), maximize=group["maximize"],
            inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf,
            validate=False, max_exp_avg_sqs=max_exp_avg_sqs,
        )


class FusedAdamW(FusedAdam):
    """Drop-in for ``torch.optim.AdamW`` (decoupled weight decay, default 1e-2); see FusedAdam.
    Its signature is AdamW's: ``decoupled_weight_decay`` is not a keyword here (it was taken
    and ignored), as torch's AdamW refuses it; a param group given
    ``decoupled_weight_decay=False`` takes Adam's L2 decay, as in torch's AdamW."""

    _adamw = True
    _torch_counterpart = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 *, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 master_weights=False, bias_correction=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, master_weights=master_weights,
                         bias_correction=bias_correction)

    def __setstate__(self, state: dict) -> None:
        """torch's AdamW: every loaded group takes decoupled weight decay, also one saved with
        ``decoupled_weight_decay=False`` (torch's ``load_state_dict`` passes the loaded groups
        through here); a group added with False keeps it, as in torch."""
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
