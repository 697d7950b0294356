"""FusedLAMB: apex FusedLAMB semantics (global grad-norm clipping, per-tensor trust ratio)."""

from __future__ import annotations

from . import functional
from ._base import FusedOptimizerBase, masters_of, state_values
from ._eager import STEP_REASON, eager_under_compile
from ._hyperparameters import check_finite_hyper, hyper_number

_PENDING = object()  # the global gradient norm of the step under way, not computed yet


class FusedLAMB(FusedOptimizerBase):
    """LAMB (You et al., 2019) with the constructor keywords of ``apex.optimizers.FusedLAMB``.

    Per step: the gradients are clipped to a global norm of ``max_grad_norm`` (over all param
    groups, as apex does; ``<= 0`` disables), Adam moments give the update
    ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p`` (``adam_w_mode``; otherwise the decay
    is added to the gradient), and each tensor moves by ``lr * ||p|| / ||u|| * u``. The trust
    ratio is 1 when either norm is 0, or when ``weight_decay == 0`` and ``use_nvlamb`` is False.
    The step count is per parameter (apex keeps one per group; they agree unless parameters
    start receiving gradients at different steps). Costs one extra read pass over the
    gradients for the global norm.
    """

    # Note [elementwise optimizers only] in elementwise.py.
    _fusedist_elementwise = False
    _fusedist_not_elementwise_because = (
        "LAMB's trust ratio takes the norms of each whole parameter and of its update, and its "
        "max_grad_norm clip the norm of all the gradients")

    _state_keys = ("exp_avg", "exp_avg_sq")
    _pickled_attrs = ("adam_w_mode", "set_grad_none", "use_nvlamb")  # Note [an optimizer pickled or copied]

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False, *, master_weights=False):
        if amsgrad:
            raise ValueError("FusedLAMB: amsgrad=True is not supported")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, master_weights=master_weights)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb
        super().__init__(params, defaults)

    def zero_grad(self, set_to_none: bool | None = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _validate_group(self, group, index):
        name = f"FusedLAMB (param group {index})"
        self._check_lr(name, group["lr"])  # a 1-element tensor too (Note [a tensor learning rate])
        check_finite_hyper(name, betas=group["betas"], eps=group["eps"],
                           weight_decay=group["weight_decay"], max_grad_norm=group["max_grad_norm"])
        beta1, beta2 = group["betas"]
        if group["eps"] < 0 or group["weight_decay"] < 0:
            raise ValueError(f"{name}: lr, eps and weight_decay must be >= 0")
        if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
            raise ValueError(f"{name}: invalid betas {group['betas']} (each must be in [0, 1))")

    @eager_under_compile(STEP_REASON)  # as the base class's step
    def step(self, closure=None):
        # apex clips with the norm over every parameter of every group: computed once, at the
        # first group's update, of the gradients the step uses -- after the base class has
        # checked every group's gradients (a sparse one is refused naming its parameter, not
        # by the norm's pass) and left a gradient replaced since fusedist's clip out of its
        # coefficient (Note [gradients changed after the clip]).
        self._global_sumsq = _PENDING
        try:
            return super().step(closure)
        finally:
            self._global_sumsq = None

    def _global_grad_sumsq(self, inv_scale, clip_coef):
        """The squared norm of all the step's gradients, ``grad * inv_scale * clip_coef``."""
        if self._global_sumsq is _PENDING:
            grads = self._fusedist_local_grads()
            factor = functional._effective_factor(inv_scale, clip_coef)
            self._global_sumsq = functional.check_and_norm(grads, factor)[1] if grads else None
        return self._global_sumsq

    def _step_group(self, group, params, grads, states, *, inv_scale, clip_coef, found_inf):
        beta1, beta2 = group["betas"]
        functional.lamb_update(
            params, grads, state_values(states, "exp_avg"), state_values(states, "exp_avg_sq"),
            masters_of(states), lr=group["lr"], beta1=hyper_number(beta1), beta2=hyper_number(beta2),
            eps=hyper_number(group["eps"]), weight_decay=hyper_number(group["weight_decay"]),
            step=state_values(states, "step"),
            bias_correction=group["bias_correction"], adam_w_mode=self.adam_w_mode,
            grad_averaging=group["grad_averaging"], max_grad_norm=hyper_number(group["max_grad_norm"]),
            use_nvlamb=self.use_nvlamb, inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf,
            global_grad_sumsq=self._global_grad_sumsq(inv_scale, clip_coef),
            validate=False,
        )
