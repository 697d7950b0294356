"""Parameters and submodules assigned into a wrapped module inside a ``torch.compile``d function.

Note [assignments inside a compiled function]
    The registration hooks that note an assignment into a wrapped module (Note [parameters replaced
    after wrapping] in trainable.py) do nothing while dynamo traces (Note [registrations while dynamo
    traces]: looking the module up made compiled forwards recompile at random). dynamo replays the
    traced assignment as a write into the module's ``_parameters`` or ``_modules`` dict, which runs
    no hook. So a Parameter assigned inside a compiled function (``model.module.fc.weight =
    nn.Parameter(...)``) was not noted: with ``find_unused_parameters=True`` it trained on each
    rank's gradient alone while the old one was reduced as zeros, silently (as under torch's DDP);
    without, the backward failed, blaming a deleted submodule. A submodule assigned there was caught
    by the tree comparison (Note [submodules written without the registration hook]), but described
    as written into ``_modules`` directly, and the Parameters it took out of the module went
    unnamed.

    Now a followed module carries a mark (``_fusedist_followed``, a plain attribute: dynamo guards
    on a module's attributes anyway, and a container a compiled forward builds has none, so slicing
    a ModuleList costs nothing), and a hook traced over a marked module appends the assignment to
    :data:`_NOTED`, which dynamo replays as it replays the assignment. The wrapper's next training
    forward, which runs eagerly (Note [bookkeeping outside compiled graphs] in wrapper.py), finds
    the list non-empty (one truthiness test per forward otherwise) and hands each entry to the
    registration hooks as if they had run: the refusal names the Parameters replaced, added or
    removed, and says they were assigned inside a compiled function.

    A Parameter set to None (``module.fc.bias = None``) runs no registration hook at all, eager or
    traced (torch registers a None without calling them), so nothing is noted: as after a submodule
    deleted (Note [submodules removed] in trainable.py), with ``find_unused_parameters`` it is an
    unused parameter reduced as zeros, which changes no result (torch's DDP trains on alike), and
    without it the error of its missing gradient names it as set to None (``unused.set_to_none``).
"""

from __future__ import annotations

MARK = "_fusedist_followed"

# (module, name, whether a Parameter, whether it replaced a submodule with parameters), in order
_NOTED: list = []


def mark(module) -> None:
    """``module`` is followed by a wrapper: an assignment into it inside a compiled function is noted."""
    module.__dict__[MARK] = True


def note_traced(module, name: str, value, parameter: bool) -> None:
    """A registration hook traced by dynamo: note the assignment if ``module`` is followed."""
    if not getattr(module, MARK, False):
        return
    replaced = False
    if not parameter:
        old = module._modules.get(name)
        replaced = old is not None and old is not value and next(old.parameters(), None) is not None
    _NOTED.append((module, name, parameter, replaced))


def any_noted() -> bool:
    return bool(_NOTED)


def take() -> list:
    """The assignments noted since the last call (the list is emptied)."""
    noted = list(_NOTED)
    _NOTED.clear()
    return noted


#: Added to the refusal's "assigned after it was wrapped".
WHERE = (", inside a torch.compile'd function (whose assignments run no registration hook: the wrapper found them "
         "at this forward)")


def replay() -> None:
    """Hand the noted assignments to the trackers that follow their modules, as the registration
    hooks would have (the module holds the new value already)."""
    from .trainable import _followed, _registered_into

    for module, name, parameter, replaced in take():
        for ref, prefix in list(_followed.get(module, ())):
            tracker = ref()
            if tracker is None:
                continue
            tracker.compiled = True
            if parameter:
                param = module._parameters.get(name)
                if param is not None:
                    tracker.note_assignment(prefix + name, param, module, name)
                continue
            if replaced and f"{prefix}{name}" not in tracker.replaced_modules:
                tracker.replaced_modules.append(f"{prefix}{name}")  # Note [submodules removed] in trainable.py
            _registered_into(tracker, module, prefix, name, module._modules.get(name))
