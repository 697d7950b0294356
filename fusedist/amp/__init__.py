"""Mixed-precision helpers: :class:`GradScaler`, torch's API with a fused, sync-free step for
fusedist optimizers (Note [scaler protocol] in :mod:`fusedist.amp.grad_scaler`)."""

from .grad_scaler import GradScaler

__all__ = ["GradScaler"]
