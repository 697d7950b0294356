"""torch.distributed.nn.functional's ``group`` defaults after ``import fusedist`` following init_process_group
(Note [binding torch.distributed.nn early] in fusedist/distributed.py): they end as an import of
torch.distributed.nn before the init leaves them -- None, the default group of each call -- so a destroyed
default group is freed at its destroy and never used after a new init.

Each case is a fresh program: the defaults are fixed at the module's first import."""

from __future__ import annotations

import json

from script_runs import run_at_once

# argv: case, rendezvous file. Prints one JSON line.
#   reference:          torch.distributed.nn imported before init_process_group (torch's behaviour to match)
#   fusedist_after:     init_process_group, then ``import fusedist`` (its import is the module's first)
#   nn_then_fusedist:   init_process_group, then the program imports torch.distributed.nn, then fusedist
#   destroyed_then_fusedist: the program imports torch.distributed.nn after init_process_group and destroys the
#                       group, then imports fusedist (prints only what the defaults hold then)
_PROGRAM = r'''
import gc, json, sys, weakref
import torch
import torch.distributed as dist

case, init = sys.argv[1], sys.argv[2]
if case == "reference":
    import torch.distributed.nn
dist.init_process_group("gloo", init_method=f"file://{init}.1", rank=0, world_size=1)
if case in ("nn_then_fusedist", "destroyed_then_fusedist"):
    import torch.distributed.nn
if case == "destroyed_then_fusedist":
    dist.destroy_process_group()
import fusedist  # noqa: F401
import torch.distributed.nn.functional as F

NAMES = ("broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather", "_all_gather_base",
         "all_to_all", "all_to_all_single", "all_reduce")


def defaults():
    """What each function's ``group`` default holds: None, "live" (the current default group) or "other"."""
    held = {}
    for name in NAMES:
        fn = getattr(F, name)
        group = dict(zip(fn.__code__.co_varnames[fn.__code__.co_argcount - len(fn.__defaults__):],
                         fn.__defaults__))["group"]
        held[name] = None if group is None else "live" if group is dist.group.WORLD else "other"
    return held


if case == "destroyed_then_fusedist":
    print(json.dumps({"after_destroy": defaults()}), flush=True)
    sys.exit(0)
out = {"while_live": defaults()}
first = weakref.ref(dist.group.WORLD)
gc.disable()  # (freed by the destroy itself, as torch frees a group nothing else holds)
dist.destroy_process_group()
out["freed_at_destroy"] = first() is None
out["after_destroy"] = defaults()
gc.enable()
dist.init_process_group("gloo", init_method=f"file://{init}.2", rank=0, world_size=1)
out["after_reinit"] = defaults()
out["all_reduce_after_reinit"] = F.all_reduce(torch.full((2,), 3.0)).tolist()
dist.destroy_process_group()
print(json.dumps(out), flush=True)
'''


def test_nn_defaults_after_fusedist_imported_past_init_match_an_import_before_init(tmp_path):
    cases = ("reference", "fusedist_after", "nn_then_fusedist", "destroyed_then_fusedist")
    runs = run_at_once({case: (_PROGRAM, case, str(tmp_path / case)) for case in cases}, timeout=120)
    got = {}
    for case, run in runs.items():
        assert run.returncode == 0, f"{case}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
        got[case] = json.loads(run.stdout.strip().splitlines()[-1])
    reference = got["reference"]
    assert set(reference["while_live"].values()) == {None}, reference
    assert reference["freed_at_destroy"] and reference["all_reduce_after_reinit"] == [3.0, 3.0], reference
    # fusedist's import is the one that would have captured the group: nothing is left of it
    assert got["fusedist_after"] == reference
    # the program's own import captured the live group (torch's behaviour while it lives); once destroyed, it
    # is neither held nor used
    mine = got["nn_then_fusedist"]
    assert set(mine["while_live"].values()) == {"live"}, mine
    assert {k: v for k, v in mine.items() if k != "while_live"} == \
        {k: v for k, v in reference.items() if k != "while_live"}
    # destroyed before fusedist's import: dropped by the import
    assert got["destroyed_then_fusedist"] == {"after_destroy": reference["after_destroy"]}
