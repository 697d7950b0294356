"""Communicator entry points against torch.distributed on gloo, on random inputs.

* A ``wait(timeout)`` under a millisecond waits for the collective, as torch's gloo work
  does (it counts whole milliseconds; 0 is "no timeout"); the gloo exchange gave up at once.
* Collectives called from a function compiled with ``torch.compile`` (fullgraph=False) give
  the eager results (they broke there: dynamo traced the gloo exchange's posting of its
  messages and failed the launch).
* A broadcast whose tensors differ in size or dtype across ranks raises a CollectiveError
  naming each rank's part, with no rank keeping a partly written tensor (gloo's own broadcast
  leaves the tail of a larger tensor stale and reports success, and terminates the process
  of a smaller one); matching broadcasts still equal torch's, on a subgroup in non-sorted
  rank order too.
* Rooted object exchanges whose ranks disagree on the root raise at once on every rank,
  naming each rank's root; a communicator whose group was destroyed refuses collectives.
* Process groups that end: what fusedist lets go of when torch destroys a group (Note [when torch
  forgets a group] in fusedist/comm/group_ends.py) -- the group too where the program still holds
  its communicator (Note [a released communicator lets go of its group] in
  fusedist/comm/released_group.py) --, and a dropped DDP wrapper whose step check is
  still pending (Note [a pending check holds its model weakly] in fusedist/reliability/engine_watch.py).
  The destroy runs no garbage collection (Note [no collection inside the destroy] in fusedist/comm/__init__.py);
  a finished collective never waited for lets go of the group at the destroy (Note [a finished collective never
  waited for]), a TorchCommunicator built directly is released like a cached one (Note [a communicator built
  directly]), and the exit hook frees a destroyed group that a reference cycle still holds.
"""

import gc
import weakref
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from fusedist.testing import run_distributed
from shared_rank_launch import fresh_compiler, launch_for_selected, results_of



def _alive_after_destroy(held: list, refs: Optional[dict] = None) -> list:
    """Destroy the group ``held[0]`` (the caller's only reference) with the collector off -- what the destroy
    frees, it frees itself -- and name what is still alive of ``refs`` (default: the group)."""
    group = held.pop()
    refs = refs if refs is not None else {"group": weakref.ref(group)}
    gc.disable()
    try:
        dist.destroy_process_group(group)
        del group
        return sorted(name for name, ref in refs.items() if ref() is not None)
    finally:
        gc.enable()

def _compiled_collectives(rank, world_size, seed):
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    comm = get_communicator(None)
    gen = torch.Generator().manual_seed(seed * 10 + rank)

    def small_max(x):
        y = x * 2
        comm.all_reduce(y, op="max")
        return y + 1

    def small_sum_async(x):
        y = x * 3
        handle = comm.all_reduce(y, async_op=True)
        z = x - 1
        handle.wait()
        return y * z

    def reduce_scatter(x):
        out = torch.empty(x.numel() // world_size)
        comm.reduce_scatter(out, x * 2, op="avg")
        return out + 1

    def all_gather(x):
        out = torch.empty(x.numel() * world_size)
        comm.all_gather(out, x + 1)
        return out * 2

    def broadcast(x):
        y = x + 1
        comm.broadcast(y, world_size - 1)
        return y * 2

    def torch_ref(name, x):
        if name == "small_max":
            y = x * 2
            dist.all_reduce(y, op=dist.ReduceOp.MAX)
            return y + 1
        if name == "small_sum_async":
            y = x * 3
            dist.all_reduce(y)
            return y * (x - 1)
        if name == "reduce_scatter":
            y = x * 2
            dist.all_reduce(y)
            return y.chunk(world_size)[rank] / world_size + 1
        if name == "all_gather":
            out = torch.empty(x.numel() * world_size)
            dist.all_gather_into_tensor(out, x + 1)
            return out * 2
        y = x + 1
        dist.broadcast(y, world_size - 1)
        return y * 2

    errors = []
    fns = {"small_max": small_max, "small_sum_async": small_sum_async, "reduce_scatter": reduce_scatter,
           "all_gather": all_gather, "broadcast": broadcast}
    for name, fn in fns.items():
        x = torch.randn(4 if name.startswith("small") else 6 * world_size, generator=gen)
        ref = torch_ref(name, x.clone())
        try:
            got = torch.compile(fn, backend="eager")(x.clone())
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        if not torch.allclose(got, ref, rtol=1e-6, atol=1e-6):
            errors.append(f"{name}: max diff {(got - ref).abs().max()}")
    return errors


def test_collectives_called_from_a_compiled_function_match_eager(launched):
    for rank_errors in results_of(launched, "compiled"):
        assert rank_errors == []


def _sub_millisecond_waits(rank, world_size, seed):
    import datetime
    import time

    import torch.distributed as dist

    from fusedist.comm import get_communicator

    comm = get_communicator(None)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    outcomes, errors = [], []
    for name in ("torch", "all_reduce_small", "reduce_scatter", "all_gather", "all_reduce"):
        x = torch.randn({"all_reduce_small": 2, "all_reduce": 100}.get(name, 6 * world_size), generator=gen)
        ref = x.clone()
        dist.all_reduce(ref, op=dist.ReduceOp.MAX)
        dist.barrier()
        if rank == 1:
            time.sleep(0.3)  # late: rank 0's waits start before the collective can complete
        out = x
        if name == "torch":
            handle = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
        elif name == "reduce_scatter":
            out, ref = torch.empty(6), ref.chunk(world_size)[rank]
            handle = comm.reduce_scatter(out, x, op="max", async_op=True)
        elif name == "all_gather":
            out, ref = torch.empty(x.numel() * world_size), torch.empty(x.numel() * world_size)
            dist.all_gather_into_tensor(ref, x)
            handle = comm.all_gather(out, x, async_op=True)
        else:
            handle = comm.all_reduce(x, op="max", async_op=True)
        try:
            handle.wait(timeout=datetime.timedelta(microseconds=500))  # torch: 0 ms, "no timeout"
            outcomes.append((name, "completed"))
        except RuntimeError as exc:
            outcomes.append((name, f"raised {exc}"))
            handle.wait()
        if not torch.equal(out, ref):
            errors.append(name)
    return outcomes, errors


def test_sub_millisecond_wait_waits_as_torch_gloo_work_does(launched):
    for outcomes, errors in results_of(launched, "sub_millisecond"):
        assert errors == []
        assert outcomes == [(name, "completed") for name, _ in outcomes], outcomes


def _broadcasts(rank, world_size, seed):
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    gen = torch.Generator().manual_seed(seed * 10 + rank)
    shared = torch.Generator().manual_seed(seed)  # the same sources on every rank
    errors = []
    order = list(range(world_size))[::-1]
    sub = dist.new_group(order)
    for group in (None, sub):
        comm = get_communicator(group)
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
            for n in (1, 37):
                src = int(torch.randint(world_size, (1,), generator=shared))
                x = torch.randn(n, generator=gen, dtype=torch.complex64 if dtype.is_complex else torch.float32)
                x = (x * 10).to(dtype)
                ours, ref = x.clone(), x.clone()
                handle = comm.broadcast(ours, src, async_op=bool(n % 2), tag="random")
                handle.wait()
                dist.broadcast(ref, dist.get_global_rank(group, src) if group is not None else src, group=group)
                if not torch.equal(ours, ref):
                    errors.append(f"group {group is not None} {dtype} n={n} src={src}")
    return errors


def test_broadcast_matches_torch_on_the_world_and_a_subgroup_in_reverse_order():
    for rank_errors in run_distributed(_broadcasts, 3, 2, timeout=120):
        assert rank_errors == []


def _mismatched_broadcast(rank, world_size, kind):
    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator(None)
    n = 10 + (3 * rank if kind == "size" else 0)
    dtype = torch.float64 if kind == "dtype" and rank == 1 else torch.float32
    tensor = torch.full((n,), float(rank + 1), dtype=dtype)
    try:
        comm.broadcast(tensor, 0, tag="model state")
    except CollectiveError as exc:
        return str(exc), tensor.tolist()
    return "no error", tensor.tolist()


def test_broadcast_of_tensors_that_differ_across_ranks_raises_naming_each_part():
    for kind, parts in (("size", ["10 x torch.float32", "13 x torch.float32"]),
                        ("dtype", ["10 x torch.float32", "10 x torch.float64"])):
        results = run_distributed(_mismatched_broadcast, 2, kind, timeout=60, env={"FUSEDIST_TIMEOUT_S": "2"})
        for rank, (message, values) in enumerate(results):
            assert "broadcast" in message and "model state" in message and parts[rank] in message, message
            assert values == [float(rank + 1)] * len(values), values  # nothing half-written


def _rooted_objects_and_destroyed_groups(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator
    from fusedist.comm.objects import broadcast_object, gather_object

    comm = get_communicator(None)
    out = {}
    for name, call in (("broadcast_object", lambda: broadcast_object(comm, {"r": rank}, rank, tag="config")),
                       ("gather_object", lambda: gather_object(comm, rank, world_size - 1 - rank, tag="stats"))):
        try:
            call()
            out[name] = "no error"
        except CollectiveError as exc:
            out[name] = str(exc)
    # the group is still in step: a matching exchange works
    out["after"] = broadcast_object(comm, {"from": rank}, 1, tag="config")
    x = torch.ones(3)
    world = weakref.ref(dist.group.WORLD)
    gc.collect()  # (what earlier scenarios left in cycles -- a compiled function's caches -- is not this one's)
    gc.disable()  # (the held communicator lets go of the default group itself: no collection of the test's)
    try:
        dist.destroy_process_group()
        out["group alive"] = world() is not None
    finally:
        gc.enable()
    try:
        comm.all_reduce(x, tag="late")
        out["destroyed"] = "no error"
    except RuntimeError as exc:
        out["destroyed"] = str(exc)
    return out


def _destroyed_subgroup_lets_go(rank, world):
    """A subgroup's communicator and monitor, then ``destroy_process_group(subgroup)``: nothing of
    fusedist's holds them, or the group, once the destroy returns."""
    from fusedist.comm import get_communicator
    from fusedist.reliability import attach_monitor

    group = dist.new_group(list(range(world)))
    comm = get_communicator(group)
    monitor = attach_monitor(comm)
    total = torch.ones(3)
    comm.all_reduce(total)
    refs = {"communicator": weakref.ref(comm), "monitor": weakref.ref(monitor), "group": weakref.ref(group)}
    del comm, monitor
    held, group = [group], None
    alive = _alive_after_destroy(held, refs)
    return {"sum": total.tolist(), "alive": alive}


def _held_communicator_lets_go(rank, world):
    """A subgroup's communicator (its exchange, gloo's own all-reduce, a background exchange and a monitor
    used), still held after ``destroy_process_group(subgroup)``: it holds the group no more, and refuses
    collectives naming them (Note [a released communicator lets go of its group] in released_group.py)."""
    from fusedist.comm import get_communicator
    from fusedist.reliability import attach_monitor

    group = dist.new_group(list(range(world)))
    comm = get_communicator(group)
    attach_monitor(comm)
    small, large, gathered = torch.ones(3), torch.ones(1000), torch.empty(2 * world)
    comm.all_reduce(small)
    comm.all_reduce(large)
    comm.all_gather(gathered, torch.full((2,), float(rank)), async_op=True).wait()
    comm.barrier()
    held, group = [group], None
    alive = bool(_alive_after_destroy(held))
    refused = {}
    for op, call in (("all_reduce", lambda: comm.all_reduce(torch.ones(3), tag="late")),
                     ("broadcast", lambda: comm.broadcast(torch.ones(3), 0, tag="late")),
                     ("all_gather", lambda: comm.all_gather(torch.empty(2 * world), torch.ones(2), async_op=True))):
        try:
            call()
            refused[op] = "no error"
        except RuntimeError as exc:
            refused[op] = str(exc)
    return {"sums": (small.tolist(), large[:2].tolist(), gathered.tolist()), "alive": alive, "refused": refused}


def _in_flight_across_the_destroy(rank, world):
    """Rank 0 launches gloo's own all-reduce on a subgroup (its parts not agreed first: the launch is gloo's at
    once) that rank 1 never joins, destroys the group, then waits: torch's destroy would block until the group's
    timeout (15 s here), freeing a group with a collective in flight."""
    import datetime
    import time

    from fusedist.comm import get_communicator

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=15))
    comm = get_communicator(group)
    comm.agree_parts, comm.timeout = False, datetime.timedelta(seconds=1)
    if rank == 1:  # (its group lives on until rank 0 is done: freed, it would close rank 0's connection)
        dist.barrier()
        dist.destroy_process_group(group)
        return {}
    handle = comm.all_reduce(torch.ones(1000), tag="alone", async_op=True)
    held = weakref.ref(group)
    start = time.monotonic()
    dist.destroy_process_group(group)
    del group
    out = {"destroy_s": time.monotonic() - start}
    try:
        handle.wait()
        out["wait"] = "no error"
    except RuntimeError as exc:
        out["wait"] = str(exc)
    gc.disable()
    try:
        del handle
        out["freed_s"], out["alive"] = time.monotonic() - start, held() is not None
    finally:
        gc.enable()
    dist.barrier()
    return out


def _dropped_wrapper_frees_its_engine(rank, world, features):
    """A DDP wrapper dropped with its last step's check still pending (carried by the last bucket where
    ``features`` makes it small enough, its own all-reduce otherwise): its engine goes with it."""
    from fusedist import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(features, features))
    model(torch.randn(4, features)).sum().backward()
    watch = model.watch
    engine = weakref.ref(model.reducer)
    carried = watch.carries(model.reducer)
    pending = watch.step_check.is_pending()
    monitor = watch.monitor
    gc.disable()
    try:
        del model, watch
        freed = engine() is None
    finally:
        gc.enable()
    # what an exit entry published now says: where the dropped model was
    position = monitor.context()
    return {"carried": carried, "pending": pending, "freed": freed,
            "position": (position.get("ddp_step"), position.get("ddp_forwards"))}


def _full_collections():
    """A list the garbage collector appends to at the start of each full collection, and its remover."""
    full = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(info)

    gc.callbacks.append(count)
    return full, lambda: gc.callbacks.remove(count)


def _destroy_collects_nothing(rank, world):
    """A DDP model and a ZeroRedundancyOptimizer over a subgroup, stepped, then ``destroy_process_group(subgroup)``
    while the program holds both (as at the end of a training ``main``): the destroy runs no full collection (it
    ran one, to free nothing: torch's destroy frame and the optimizer held the group, no cycle), and the group
    goes as the program drops its objects."""
    import time

    from fusedist import DistributedDataParallel, ZeroRedundancyOptimizer

    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 4), process_group=group)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, process_group=group)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    opt.step()
    held = weakref.ref(group)
    full, stop_counting = _full_collections()
    gc.disable()
    try:
        start = time.perf_counter()
        dist.destroy_process_group(group)
        destroy_s = time.perf_counter() - start
        del group
        collections = len(full)
        del model, opt
        freed = held() is None
    finally:
        gc.enable()
        stop_counting()
    return {"collections": collections, "destroy_s": destroy_s, "freed": freed}


def _finished_handle_lets_go(rank, world):
    """A DDP backward leaves its step check's all-reduce launched and unwaited (read at the next forward); the
    group is destroyed before that forward: the finished collective's handle no longer holds it."""
    from fusedist import DistributedDataParallel

    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
    model(torch.randn(4, 4)).sum().backward()
    pending = model.watch.step_check.is_pending()
    held, group = [group], None
    alive = bool(_alive_after_destroy(held))
    return {"pending": pending, "alive": alive}


def _built_directly_is_released(rank, world):
    """A TorchCommunicator built directly (not by get_communicator), its exchange's progress thread used: the
    destroy releases it -- the group freed, the thread stopped -- and it refuses collectives naming the destroy."""
    import threading

    from fusedist.comm import TorchCommunicator

    group = dist.new_group(list(range(world)))
    before = set(threading.enumerate())
    comm = TorchCommunicator(group, gloo_collectives="p2p")
    out = torch.empty(2)
    comm.reduce_scatter(out, torch.full((2 * world,), float(rank + 1)), async_op=True).wait()
    progress = [t for t in set(threading.enumerate()) - before if t.name == "fusedist-gloo-exchange"]
    held, group = [group], None
    alive = bool(_alive_after_destroy(held))
    try:
        comm.all_reduce(torch.ones(3), tag="late")
        late = "no error"
    except RuntimeError as exc:
        late = str(exc)
    for t in progress:
        t.join(timeout=10)
    return {"sum": out.tolist(), "alive": alive, "released": comm.released, "late": late,
            "progress_ended": bool(progress) and not any(t.is_alive() for t in progress)}


def _default_group_initialized_again(rank, world):
    """(After the rooted scenario: a default group of this rank alone.) torch's DDP and fusedist's DDP with a stage-2
    ZeroRedundancyOptimizer over a default group, which is destroyed and initialized again: process groups compared
    (None: the default group now; the destroyed one matches none), both models wrapped again by fusedist."""
    from fusedist import DistributedDataParallel, ZeroRedundancyOptimizer
    from fusedist.ddp.succession import same_ranks

    if dist.is_initialized():  # (the rooted scenario was not selected)
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    torch_net, net = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(torch_net)
    old = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(old.parameters(), torch.optim.SGD, lr=0.1, stage=2)
    old(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    destroyed = dist.group.WORLD
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {"same_ranks": {}}
    for name, a, b in (("None, new", None, dist.group.WORLD), ("destroyed, new", destroyed, dist.group.WORLD),
                       ("destroyed, None", destroyed, None), ("destroyed, destroyed", destroyed, destroyed)):
        try:
            out["same_ranks"][name] = same_ranks(a, b)
        except Exception as exc:  # noqa: BLE001 - the test names it
            out["same_ranks"][name] = f"{type(exc).__name__}: {exc}"
    try:
        DistributedDataParallel(torch.nn.Sequential(torch_ddp))
        out["around torch's"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["around torch's"] = f"{type(exc).__name__}: {exc}"
    x = torch.randn(3, 4)
    expected = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
    try:
        newer = DistributedDataParallel(net)
        newer(x).square().sum().backward()
        out["grads match"] = all(torch.allclose(p.grad, g) for p, g in zip(net.parameters(), expected))
    except Exception as exc:  # noqa: BLE001
        out["grads match"] = f"{type(exc).__name__}: {exc}"
    try:
        opt.step()
        out["old step"] = "no error"
    except RuntimeError as exc:
        out["old step"] = str(exc)
    dist.destroy_process_group()
    return out


def _exit_frees_a_group_a_cycle_holds(rank, world):
    """(Last: its own default group, of this rank alone.) A group in use that a reference cycle holds, destroyed:
    no collection at the destroy, and the exit hook's one collection frees it before the interpreter finalizes."""
    from fusedist.comm import _drain_at_exit, get_communicator

    if dist.is_initialized():  # (the rooted scenario was not selected)
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    get_communicator(None).all_reduce(torch.ones(2))
    cycle = {"group": dist.group.WORLD}  # (as a ZeroRedundancyOptimizer in a cycle holds its process_group)
    cycle["self"] = cycle
    held = weakref.ref(dist.group.WORLD)
    full, stop_counting = _full_collections()
    gc.disable()
    try:
        dist.destroy_process_group()
        del cycle
        at_destroy = (len(full), held() is not None)
        _drain_at_exit()  # what runs at interpreter exit
        at_exit = (len(full), held() is not None)
    finally:
        gc.enable()
        stop_counting()
    return {"at_destroy": at_destroy, "at_exit": at_exit}


SCENARIOS = {
    "test_collectives_called_from_a_compiled_function_match_eager": {
        "compiled": (fresh_compiler, (_compiled_collectives, 1)),
    },
    "test_sub_millisecond_wait_waits_as_torch_gloo_work_does": {
        "sub_millisecond": (_sub_millisecond_waits, (3,)),
    },
    "test_destroying_a_group_releases_its_communicator_and_monitor_at_once": {
        "subgroup": (_destroyed_subgroup_lets_go, ()),
    },
    "test_a_held_communicator_lets_go_of_its_destroyed_group_and_refuses_collectives": {
        "held": (_held_communicator_lets_go, ()),
        "in_flight": (_in_flight_across_the_destroy, ()),
    },
    "test_a_dropped_ddp_wrapper_with_a_pending_step_check_frees_its_engine_at_once": {
        "carried": (_dropped_wrapper_frees_its_engine, (200,)),
        "own_check": (_dropped_wrapper_frees_its_engine, (4,)),
    },
    "test_a_destroy_runs_no_collection_and_lets_go_of_finished_and_directly_built_holders": {
        "no_collection": (_destroy_collects_nothing, ()),
        "finished_handle": (_finished_handle_lets_go, ()),
        "built_directly": (_built_directly_is_released, ()),
    },
    # (last: it destroys the default group)
    "test_rooted_object_exchanges_disagreeing_on_the_root_and_destroyed_groups_raise": {
        "rooted": (_rooted_objects_and_destroyed_groups, ()),
    },
    # (after it: default groups of their own)
    "test_a_default_group_destroyed_and_initialized_again_matches_no_group_of_its_old_wrappers": {
        "reinit": (_default_group_initialized_again, ()),
    },
    "test_the_exit_hook_frees_a_destroyed_group_a_reference_cycle_holds": {
        "exit_cycle": (_exit_frees_a_group_a_cycle_holds, ()),
    },
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=240, env={"FUSEDIST_TIMEOUT_S": "10"})


def test_rooted_object_exchanges_disagreeing_on_the_root_and_destroyed_groups_raise(launched):
    for out in results_of(launched, "rooted"):
        assert "rank 0: config (from rank 0); rank 1: config (from rank 1)" in out["broadcast_object"], out
        assert "rank 0: stats (to rank 1); rank 1: stats (to rank 0)" in out["gather_object"], out
        assert out["after"] == {"from": 1}
        assert "all_reduce [late]" in out["destroyed"] and "destroyed" in out["destroyed"], out["destroyed"]
        assert "the default process group of this communicator was destroyed" in out["destroyed"], out["destroyed"]
        assert not out["group alive"], "the held communicator kept the destroyed default group alive"


def test_destroying_a_group_releases_its_communicator_and_monitor_at_once(launched):
    for rank, out in enumerate(results_of(launched, "subgroup")):
        assert out["sum"] == [2.0, 2.0, 2.0], f"rank {rank}: {out['sum']}"
        assert out["alive"] == [], f"rank {rank}: still alive right after destroy_process_group(group): {out['alive']}"


def test_a_held_communicator_lets_go_of_its_destroyed_group_and_refuses_collectives(launched):
    for rank, out in enumerate(results_of(launched, "held")):
        small, large, gathered = out["sums"]
        assert small == [2.0] * 3 and large == [2.0] * 2, f"rank {rank}: {out['sums']}"
        assert gathered == [0.0, 0.0, 1.0, 1.0], f"rank {rank}: {out['sums']}"
        assert not out["alive"], f"rank {rank}: the held communicator kept its destroyed group alive"
        for op, message in out["refused"].items():
            assert message.startswith(f"fusedist {op}") and f"on rank {rank} of 2: not launched" in message, message
            assert "the process group of this communicator was destroyed" in message, message
    # a collective in flight across the destroy keeps the group until its wait ends: the destroy returns at once,
    # the wait fails at fusedist's deadline (1 s) naming the destroy, and the group goes with the handle
    out = results_of(launched, "in_flight")[0]
    assert out["destroy_s"] < 5, f"the destroy waited {out['destroy_s']:.1f} s for the collective in flight"
    assert "all_reduce (tag 'alone'" in out["wait"] and "rank 0 of 2" in out["wait"], out["wait"]
    assert "destroyed (torch.distributed.destroy_process_group()) while this collective" in out["wait"], out["wait"]
    assert not out["alive"] and out["freed_s"] < 10, f"the group outlived the failed wait: {out}"


def test_a_dropped_ddp_wrapper_with_a_pending_step_check_frees_its_engine_at_once(launched):
    for scenario, carried in (("carried", True), ("own_check", False)):
        for rank, out in enumerate(results_of(launched, scenario)):
            assert out["carried"] is carried and out["pending"], f"{scenario}, rank {rank}: not the case meant: {out}"
            assert out["freed"], f"{scenario}, rank {rank}: the engine outlived its dropped wrapper"
            assert out["position"] == (1, 1), f"{scenario}, rank {rank}: the dropped model's position: {out}"


def test_a_destroy_runs_no_collection_and_lets_go_of_finished_and_directly_built_holders(launched):
    for rank, out in enumerate(results_of(launched, "no_collection")):
        assert out["collections"] == 0, f"rank {rank}: the destroy ran {out['collections']} full collection(s)"
        assert out["freed"], f"rank {rank}: the destroyed group outlived the model and optimizer holding it"
    for rank, out in enumerate(results_of(launched, "finished_handle")):
        assert out["pending"], f"rank {rank}: not the case meant (no step check left unwaited): {out}"
        assert not out["alive"], f"rank {rank}: a finished, unwaited collective kept the destroyed group alive"
    for rank, out in enumerate(results_of(launched, "built_directly")):
        assert out["sum"] == [3.0, 3.0], f"rank {rank}: {out['sum']}"
        assert out["released"] and not out["alive"], f"rank {rank}: the directly built communicator kept its group"
        assert out["progress_ended"], f"rank {rank}: its exchange's progress thread outlived the destroy"
        assert out["late"].startswith("fusedist all_reduce [late]"), out["late"]
        assert "the process group of this communicator was destroyed" in out["late"], out["late"]


def test_the_exit_hook_frees_a_destroyed_group_a_reference_cycle_holds(launched):
    for rank, out in enumerate(results_of(launched, "exit_cycle")):
        assert out["at_destroy"] == (0, True), f"rank {rank}: (collections, alive) after the destroy: {out}"
        assert out["at_exit"] == (1, False), f"rank {rank}: (collections, alive) after the exit hook: {out}"


def test_a_default_group_destroyed_and_initialized_again_matches_no_group_of_its_old_wrappers(launched):
    for rank, out in enumerate(results_of(launched, "reinit")):
        assert out["same_ranks"] == {"None, new": True, "destroyed, new": False, "destroyed, None": False,
                                     "destroyed, destroyed": True}, f"rank {rank}: {out['same_ranks']}"
        # torch's wrapper over the destroyed group: refused by name (was a bare KeyError naming the group object)
        assert out["around torch's"].startswith("RuntimeError: fusedist.DistributedDataParallel"), out["around torch's"]
        assert "torch's DistributedDataParallel" in out["around torch's"], out["around torch's"]
        # the newer wrapper trains (its gradients: autograd's, world of one); it took over nothing of the old one's
        assert out["grads match"] is True, f"rank {rank}: {out['grads match']}"
        assert out["old step"].startswith("ZeroRedundancyOptimizer(stage=2)"), out["old step"]
        assert "its DistributedDataParallel model's process group was destroyed" in out["old step"], out["old step"]
