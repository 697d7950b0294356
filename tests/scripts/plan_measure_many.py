"""Several ``python -m fusedist.plan --measure`` runs in one torchrun job, as a test's
launches would run them one by one: each case is the CLI's own ``main`` with its arguments,
its output and exit status marked so the test can split them (one launch instead of one per
case: each launch pays for starting the ranks and importing torch).

Usage: ``plan_measure_many.py WARMUP CASES_JSON`` where CASES_JSON holds a list of argument
lists; WARMUP sets the untimed steps each strategy trains first (the CLI's are 3: the
figures read here settle after one, since nothing a later step allocates or sends differs).
"""

import functools
import json
import os
import sys
import traceback

import torch.distributed as dist

import fusedist.plan.measure as measure
from fusedist.plan import cli

MARK = "@@ case"


def _fresh_group(i: int) -> None:
    """The process group of case ``i`` > 0, under its own prefix of the launch's store: the
    CLI destroys its group at the end, and a group made again from ``env://`` reuses the first
    one's store keys (the group count starts over), where a rank could read the old group's
    addresses and wait forever. Case 0 keeps the CLI's own initialization; later cases find
    this group made, as ``fusedist.init_distributed`` allows."""
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"case{i}/", store), rank=rank, world_size=world)


def main(warmup: int, cases: list) -> int:
    measure.run = functools.partial(measure.run, warmup=warmup)  # the CLI imports it at call time
    def mark(text):  # rank 0 prints the results; its marks alone split them
        if os.environ.get("RANK") == "0":
            print(f"{MARK} {text}", flush=True)

    worst = 0
    for i, args in enumerate(cases):
        mark(f"{i} start")
        try:
            if i:
                _fresh_group(i)
            code = cli.main(args)
        except Exception:  # reported, and no case after it: the ranks may not agree on where they are
            traceback.print_exc()
            mark(f"{i} exit 99")
            return 99
        mark(f"{i} exit {code}")
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        sys.exit(main(int(sys.argv[1]), json.load(f)))
