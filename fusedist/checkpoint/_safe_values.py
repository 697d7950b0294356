"""Whether a state can be read back by the safe loader (``torch.load(weights_only=True)``),
checked before a ``Checkpointer`` writes it.

Note [checkpoints the restore cannot read]
Checkpoint files are read with torch's restricted unpickler unless ``trusted=True``
(``_files.load_file``). A value it refuses -- most often a NumPy scalar, ``np.float64`` from
``np.mean``, in ``extra`` or in a param group's ``lr`` -- was written without a word, and the
job's next ``restore`` (the same script, restarted by torchrun, ``trusted=False``) found every
checkpoint unreadable: "no checkpoint ... could be loaded", a job that cannot resume from any
of the checkpoints it kept. A Checkpointer knows how its job restores (``restore`` runs before
the first save), so when that restore was not trusted, each save walks what it writes and
refuses, before anything is written, a value the restore could not read, naming where it is.
Plain leaves and containers are decided by type; anything else (a subclass, a NumPy value, a
user object) by a round trip of that value alone through the safe loader, so the verdict is
the loader's own.
"""

from __future__ import annotations

import collections
import io
from typing import Any, Optional

import torch

_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
                 torch.Tensor, torch.nn.Parameter)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple)


def _loads_back(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal of the safe loader
        return False
    return True


def first_unreadable(value: Any, where: str) -> Optional[str]:
    """Where in ``value`` (named from ``where``, e.g. ``extra['best']``) the first value the
    safe loader refuses is, with its type; None when it reads all of it."""
    kind = type(value)
    if kind in _PLAIN_LEAVES:
        return None
    if kind in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and type(key) not in _PLAIN_LEAVES:
                if not _loads_back(key):
                    return f"a key of {where} ({type(key).__module__}.{type(key).__qualname__})"
            found = first_unreadable(item, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if _loads_back(value):
        return None
    return f"{where} ({kind.__module__}.{kind.__qualname__})"
