"""Communicators built directly per world (no default process group), one driver per backend.

A driver builds the world's ProcessGroup on the world's own store, says how an awaited op
completes, frees callers blocked in a broken world's ops, and aborts communicators. gloo and
NCCL share everything else (core.py, ops.py).
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch._C._distributed_c10d import Backend, BarrierOptions, ProcessGroup, Store

from multiworld.errors import UnsupportedOpError, WorldBrokenError, WorldJoinError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import ProcessGroupNCCL
    from torch.distributed.distributed_c10d import GroupName

log = logging.getLogger(__name__)

# NCCL settings that would let one world's error kill the whole process: the watchdog's
# TearDown (1) and SkipCleanUp (3) modes, and the monitor thread that aborts a process whose
# watchdog is stuck. Each world is aborted by this library instead.
_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_NCCL_ERROR_HANDLING_LEGACY = "NCCL_ASYNC_ERROR_HANDLING"
_NCCL_SAFE_ERROR_HANDLING = ("0", "2")
_NCCL_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"

# Aborting several NCCL communicators one after another can deadlock (pytorch#119797); they
# are aborted inside one NCCL group, one batch at a time.
_nccl_abort_lock = threading.Lock()

# A gloo recv that times out closes every pair of its communicator (see GlooDriver.interrupt);
# nothing is ever sent with this tag.
_INTERRUPT_WAIT = timedelta(milliseconds=1)
_INTERRUPT_TAG = 2**31 - 1

# One gloo device (a listening socket and the loop thread that serves every pair's I/O) for all
# the gloo worlds of this process: each device's loop wakes periodically even when idle, so a
# device per world would cost CPU in proportion to the idle worlds (bench/heartbeats.py
# measures a process's idle CPU by the number of worlds).
_gloo_device: Any = None
_gloo_device_lock = threading.Lock()


def _shared_gloo_device() -> Any:
    global _gloo_device
    from torch.distributed import ProcessGroupGloo

    with _gloo_device_lock:
        if _gloo_device is None:
            _gloo_device = ProcessGroupGloo.create_default_device()
        return _gloo_device


class Tracked(Protocol):
    """What a driver may tell the Work of an async op it tracks (work.Work)."""

    def settle(self, error: WorldBrokenError | None) -> None:
        """The op completed (error None) or failed."""
        ...

    def on_future(self, fut: Any) -> None:
        """The op's torch Future is done: settle from its value."""
        ...

    def wait_here(self) -> None:
        """Wait for the op in the calling thread, then settle; its failure breaks the world
        and raises."""
        ...


class Driver(Protocol):
    name: str
    # Ops whose async works have no future: a waiter thread waits for them.
    waited_ops: frozenset[str]
    # Ops whose arguments the backend checks before it posts anything, so that the library
    # checks them only after a refusal, to name the bad one (see ops.Collectives._not_started).
    self_checked: frozenset[str]

    @property
    def device(self) -> torch.device | None:
        """Where tensors must live (None: anywhere the backend accepts)."""
        ...

    def build(self, store: Store, rank: int, size: int, timeout: timedelta, group_name: str) -> ProcessGroup: ...

    def track(self, torch_work: Any, work: Tracked) -> None:
        """An op started with async_op=True: settle `work` when the op completes."""
        ...

    def interrupt(self, comm: Backend, rank: int, size: int) -> None:
        """The world broke: end every wait on this communicator's ops (callers blocked in them)."""
        ...

    def barrier_options(self) -> BarrierOptions: ...
    def abort(self, pgs: list[ProcessGroup]) -> None: ...
    def check_reduce_op(self, op: str, reduce_op: str) -> None: ...


def make_driver(backend: str, device: str | torch.device | None) -> Driver:
    if backend == "gloo":
        return GlooDriver()
    if backend == "nccl":
        return NcclDriver(nccl_device(device))
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _register(pg: ProcessGroup, device: torch.device, kind: ProcessGroup.BackendType, backend: Any) -> None:
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, backend)


class GlooDriver:
    """A blocking op waits in its caller's own thread with a plain `wait()`: a timed wait costs
    more per op, and a verdict on the world frees the caller through `interrupt`."""

    name = "gloo"
    # send/recv: no future; reduce_scatter: no future, and its wait ignores the timeout.
    waited_ops = frozenset({"send", "recv", "reduce_scatter"})
    # gloo's all_gather refuses a wrong list, shape or dtype, and copies strided tensors
    # correctly (torch 2.13): checking them again first would add to every all_gather's time
    # (bench/collectives.py).
    self_checked = frozenset({"send", "recv", "all_gather"})
    device = None

    def build(self, store: Store, rank: int, size: int, timeout: timedelta, group_name: str) -> ProcessGroup:
        from torch.distributed import ProcessGroupGloo

        # torch's stubs lack the private _Options (the C++ options with _devices and _threads).
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [_shared_gloo_device()]
        # One worker thread, not torch's two: a world's collectives run in the order they were
        # called on every rank anyway, and p2p ops never use the workers.
        options._threads = 1
        backend = ProcessGroupGloo(store, rank, size, options)
        backend._set_sequence_number_for_group()
        pg = ProcessGroup(store, rank, size)
        _register(pg, torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
        if torch.cuda.is_available():
            pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, backend)
        pg._set_group_name(cast("GroupName", group_name))
        return pg

    def track(self, torch_work: Any, work: Tracked) -> None:
        torch_work.get_future().add_done_callback(work.on_future)

    def interrupt(self, comm: Backend, rank: int, size: int) -> None:
        """Time out a recv that nothing answers: gloo then closes every pair of the
        communicator ("Application timeout caused pair closure"), which fails every op in
        flight on it, collectives included, and frees their waits (measured on torch 2.13)."""
        # One peer at a time: a pair that a peer closed first fails the recv with that error
        # instead of a timeout, and closes nothing else.
        for peer in range(size):
            if peer == rank:
                continue
            try:
                # torch's stubs omit a Backend's ops (bound in C++); this is a ProcessGroupGloo.
                work = comm.recv([torch.empty(1, dtype=torch.uint8)], peer, _INTERRUPT_TAG)  # type: ignore[attr-defined]
            except RuntimeError:
                continue  # this pair is closed already
            try:
                work.wait(_INTERRUPT_WAIT)
            except RuntimeError:
                pass  # timed out (every pair is closed now), or this pair was closed

    def barrier_options(self) -> BarrierOptions:
        return BarrierOptions()

    def abort(self, pgs: list[ProcessGroup]) -> None:
        for pg in pgs:
            pg.abort()

    def check_reduce_op(self, op: str, reduce_op: str) -> None:
        if reduce_op in ("AVG", "PREMUL_SUM"):
            raise UnsupportedOpError(op, self.name, f"ReduceOp.{reduce_op}")


def nccl_device(device: str | torch.device | None) -> torch.device:
    """The CUDA device of this process: `device`, else cuda:LOCAL_RANK, else the current one."""
    if not torch.cuda.is_available():
        raise WorldJoinError("backend nccl needs a CUDA device, and none is available here")
    if device is None:
        local_rank = os.environ.get("LOCAL_RANK", "").strip()
        if local_rank:
            if not local_rank.isdigit():
                raise ValueError(f"LOCAL_RANK={local_rank!r} is not a device index")
            device = torch.device("cuda", int(local_rank))
        else:
            device = torch.device("cuda", torch.cuda.current_device())
    resolved = torch.device(device)
    if resolved.type != "cuda":
        raise ValueError(f"device {resolved} is not a CUDA device; backend nccl needs one")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    if resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {resolved} does not exist: {torch.cuda.device_count()} CUDA device(s) here")
    return resolved


def make_nccl_env_safe() -> None:
    """Make sure an NCCL error or a stuck watchdog never tears the process down (read by each
    ProcessGroupNCCL when it is built)."""
    handling = os.environ.get(_NCCL_ERROR_HANDLING, os.environ.get(_NCCL_ERROR_HANDLING_LEGACY))
    if handling not in _NCCL_SAFE_ERROR_HANDLING:
        if handling is not None:
            log.warning("%s=%s would kill the process on one world's error; using 0", _NCCL_ERROR_HANDLING, handling)
        os.environ[_NCCL_ERROR_HANDLING] = "0"
    if os.environ.get(_NCCL_MONITORING) != "0":
        if os.environ.get(_NCCL_MONITORING) is not None:
            log.warning("%s=%s could kill the process; using 0", _NCCL_MONITORING, os.environ[_NCCL_MONITORING])
        os.environ[_NCCL_MONITORING] = "0"


class NcclDriver:
    name = "nccl"
    waited_ops: frozenset[str] = frozenset()
    self_checked = frozenset({"send", "recv"})

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(self, store: Store, rank: int, size: int, timeout: timedelta, group_name: str) -> ProcessGroup:
        from torch.distributed import ProcessGroupNCCL

        make_nccl_env_safe()
        torch.cuda.set_device(self.device)
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = ProcessGroupNCCL(store, rank, size, options)
        backend._set_sequence_number_for_group()
        # Build the communicator now, inside the join, not at the first op.
        backend.eager_connect_single_device(self.device)
        pg = ProcessGroup(store, rank, size)
        _register(pg, self.device, ProcessGroup.BackendType.NCCL, backend)
        pg.bound_device_id = self.device
        pg._set_group_name(cast("GroupName", group_name))
        return pg

    def track(self, torch_work: Any, work: Tracked) -> None:
        """torch's semantics for NCCL: the caller's current CUDA stream waits for the op's
        stream, the CPU goes on. An error that shows later (a peer gone mid-op) breaks the
        world through the heartbeat, and the op's outputs are garbage then.

        The works' futures are not used: ProcessGroupNCCL completes them when the op is
        queued, and off the root a gather's or scatter's future fails on an undefined tensor
        ("Cannot access storage of UndefinedTensorImpl")."""
        # Ordered on the caller's stream now: NCCL writes the outputs on its own stream, and a
        # caller that went on without this wait could read them before they are written.
        work.wait_here()

    def interrupt(self, comm: Backend, rank: int, size: int) -> None:
        return None  # an NCCL wait never blocks the CPU (the caller's stream waits instead)

    def barrier_options(self) -> BarrierOptions:
        options = BarrierOptions()
        options.device_ids = [self.device.index]
        return options

    def abort(self, pgs: list[ProcessGroup]) -> None:
        if not pgs:
            return
        with _nccl_abort_lock:
            group = cast("ProcessGroupNCCL", pgs[0]._get_backend(self.device))  # the one build() registered
            group._group_start()
            try:
                for pg in pgs:
                    pg.abort()
            finally:
                group._group_end()

    def check_reduce_op(self, op: str, reduce_op: str) -> None:
        return None
