"""A back-reference from a ZeroRedundancyOptimizer's helper objects to the optimizer, held weakly.

The optimizer owns its helpers (state dicts, parameters with no elements); a strong reference
back made a cycle, so a dropped optimizer -- its masters, states and layout callbacks -- lived
on until the cyclic garbage collector ran, and was grown by DDP layout changes meanwhile.
"""

from __future__ import annotations

import weakref


class HeldByOptimizer:
    """``self.zero``: the owning optimizer, alive whenever a helper is used (reached through it)."""

    def _hold(self, zero) -> None:
        self._zero = weakref.ref(zero)

    @property
    def zero(self):
        return self._zero()
