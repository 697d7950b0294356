"""Mixed-precision helpers: :class:`GradScaler`, torch's API with a fused, sync-free step for
fusedist optimizers (Note [scaler protocol] in :mod:`fusedist.amp.grad_scaler`), and
:func:`choose_precision`, which picks the weights' dtype the device computes fastest."""

from .grad_scaler import GradScaler
from .precision import PrecisionChoice, choose_precision

__all__ = ["GradScaler", "PrecisionChoice", "choose_precision"]
