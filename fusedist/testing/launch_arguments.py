"""``run_distributed``'s numeric arguments, checked before any rank starts.

A world of 0 (or a negative one) started no rank and returned ``[]``: a test over it passed having
run nothing. A NaN ``timeout`` started the ranks and then failed inside the harness's wait with
"cannot convert float NaN to integer"; a negative one killed every rank at once as "did not finish
within -1 s"; a NaN ``pg_timeout`` failed every rank inside ``timedelta``, and 0 made a group whose
timeout gloo reads as its own default. Each is refused here, naming the argument and its value.
"""

from __future__ import annotations

import math
import numbers


def check_launch_arguments(world_size, timeout, pg_timeout) -> None:
    """Raise a TypeError or ValueError naming the argument unless ``world_size`` is a whole number
    >= 1 and ``timeout`` and ``pg_timeout`` are finite numbers of seconds > 0."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise TypeError(f"run_distributed(world_size={world_size!r}): the number of ranks is a whole number "
                        f"(int), got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"run_distributed(world_size={world_size}): at least one rank is needed; with none, "
                         "nothing would run and the call would return [] as if every rank had passed")
    for name, seconds in (("timeout", timeout), ("pg_timeout", pg_timeout)):
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not (
                math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"run_distributed({name}={seconds!r}): give a finite number of seconds > 0")
