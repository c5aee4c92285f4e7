"""The per-world ops, with torch.distributed's argument names.

Every op checks its arguments (a clear error naming the argument) and runs on the world's own
communicator (the backend under its ProcessGroup, called directly: the ProcessGroup's dispatch
costs as much as the rest of an op's Python side). Ranks are always checked before anything is
posted, and so are tensors, except for the ops whose backend checks them itself
(`Driver.self_checked`): those are checked only after the backend refused them, to name the bad
argument. `async_op=False` blocks and returns None; `async_op=True` returns a `Work` to
`await`, `wait()` or poll. Options objects are cached per world: building one costs about as
much as the rest of the Python side of an op. So are the communicator's methods (see `bind`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    Backend,
    BroadcastOptions,
    GatherOptions,
    ReduceOp as TorchReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from torch.distributed import DistError

from multiworld.errors import UnsupportedOpError, WorldBrokenError, says_unsupported, short
from multiworld.world.reduce_op import ReduceOp
from multiworld.world.work import InFlight, Waiters, Work

if TYPE_CHECKING:
    from multiworld.world.backends import Driver

AnyReduceOp = ReduceOp | TorchReduceOp | TorchReduceOp.RedOpType | str


def _reduce_op_name(op: AnyReduceOp) -> str:
    if isinstance(op, ReduceOp):
        return op.value
    if isinstance(op, TorchReduceOp.RedOpType):
        return op.name
    if isinstance(op, TorchReduceOp):  # an instance, e.g. PREMUL_SUM with its factor
        for name in (*ReduceOp.__members__, "PREMUL_SUM"):
            if op == getattr(TorchReduceOp, name):
                return name
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return op.upper()
    raise ValueError(f"op must be a ReduceOp (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR), got {op!r}")


def _lost_peer(exc: RuntimeError) -> bool:
    """Whether an op failed to start because the communicator lost a peer: NCCL checks its
    communicator then (a DistError), and gloo's send and recv fail on a pair already closed
    (its transport's errors name their source file, gloo/transport/...)."""
    return isinstance(exc, DistError) or "gloo/transport/" in str(exc)


# The Backend method behind each op.
_METHODS = {
    "send": "send",
    "recv": "recv",
    "broadcast": "broadcast",
    "all_reduce": "allreduce",
    "reduce": "reduce",
    "all_gather": "allgather",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "alltoall",
    "barrier": "barrier",
}


def bind(comm: Backend) -> dict[str, Callable[..., Any]]:
    """The communicator's method for each op, bound once. Looking it up by name on every op
    (getattr, then a call with unpacked arguments) is paid on every op, and showed in the
    library's time against raw torch (bench/collectives.py)."""
    return {op: getattr(comm, method) for op, method in _METHODS.items()}


def refusing(error: WorldBrokenError) -> dict[str, Callable[..., Any]]:
    """What a broken world posts ops with: every op raises `error` (the ops need no check of
    their own, and the communicator is no longer referenced from here)."""

    def refuse(*args: Any) -> NoReturn:
        raise error.fresh()

    return dict.fromkeys(_METHODS, refuse)


def _check_tensor(name: str, tensor: Any, device: torch.device | None) -> None:
    """Raise a clear error for a bad tensor. broadcast, all_reduce and reduce (one tensor and
    nothing else to check) test the usual case inline first (`type(tensor) is not Tensor or
    self._device is not None or not tensor.is_contiguous()`) and call this only when that holds:
    a frame and a type lookup less on every op."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        # gloo reads the storage as if contiguous: a strided view gives wrong results silently.
        raise ValueError(f"{name} must be contiguous (use .contiguous())")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but this world communicates on {device}")


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)} and dtype {tensor.dtype}"


def _check_p2p(world: Collectives, args: tuple[Any, ...]) -> None:
    _check_tensor("tensor", args[0][0], world._device)


def _check_all_gather(world: Collectives, args: tuple[Any, ...]) -> None:
    (tensor_list,), (tensor,), _ = args
    _check_tensor("tensor", tensor, world._device)
    world._check_list("tensor_list", tensor_list, tensor, "tensor")


# The argument checks of the ops a backend may check itself (see Driver.self_checked), by op:
# they run before posting where the backend does not, and after its refusal where it does.
# The other collectives are always checked first: gloo reads a strided view as if contiguous.
ARGUMENT_CHECKS: dict[str, Callable[[Collectives, tuple[Any, ...]], None]] = {
    "send": _check_p2p,
    "recv": _check_p2p,
    "all_gather": _check_all_gather,
}


class Collectives:
    """The ops of one world at one epoch, on its communicator `comm`: the base of `World`
    (world/core.py), which adds membership, failure detection and release.

    The state the ops use is set up here. `in_flight`: the world's async works not settled
    yet, how an op that fails as it runs breaks the world, and the world's op metrics (kept at
    hand as `_recorder`; see work.InFlight). What World itself uses of it: `_driver`,
    `_waiters`, `_error` (None while healthy) and `_refuse`, which it calls when the world
    breaks.
    """

    def __init__(self, name: str, rank: int, size: int, comm: Backend, driver: Driver, in_flight: InFlight) -> None:
        self.name = name
        self.rank = rank
        self.size = size
        self._post = bind(comm)
        self._driver = driver
        self._device = driver.device
        self._ranks = frozenset(range(size))
        self._peers = self._ranks - {rank}
        self._error: WorldBrokenError | None = None
        self._in_flight = in_flight
        self._recorder = in_flight.recorder
        self._waiters = Waiters(name) if driver.waited_ops else None
        self._options: dict[tuple[object, ...], Any] = {}

    def _refuse(self, error: WorldBrokenError) -> set[Work]:
        """The world broke (its lock held): every op from now on raises `error`. Returns the
        works in flight, which the caller fails."""
        self._error = error
        self._post = refusing(error)
        return self._in_flight.take()

    # -- argument checks ---------------------------------------------------------------

    def _check_rank(self, name: str, rank: Any, *, peer: bool = False) -> None:
        """Raise a clear error for a bad rank. The ops test `type(rank) is int and rank in
        self._ranks` (or `_peers`) inline first and call this only when that fails: a rank out of
        range must never reach gloo (it waits for a peer that does not exist, or aborts)."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{name} must be an int rank, got {rank!r}")
        if not 0 <= rank < self.size:
            raise ValueError(f"{name}={rank} is out of range for world {self.name!r} of size {self.size}")
        if peer and rank == self.rank:
            raise ValueError(f"{name}={rank} is this process's own rank in world {self.name!r}")

    def _check_list(self, name: str, tensors: Any, like: torch.Tensor | None, like_name: str) -> list[torch.Tensor]:
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{name} must be a list of {self.size} tensors, got {type(tensors).__name__}")
        if len(tensors) != self.size:
            raise ValueError(
                f"{name} must hold {self.size} tensors (one per rank of world {self.name!r}), got {len(tensors)}"
            )
        for i, tensor in enumerate(tensors):
            _check_tensor(f"{name}[{i}]", tensor, self._device)
            if like is not None and (tensor.shape != like.shape or tensor.dtype != like.dtype):
                raise ValueError(f"{name}[{i}] has {_describe(tensor)}, but {like_name} has {_describe(like)}")
        return list(tensors)

    def _root_list(
        self, name: str, tensors: Any, like: torch.Tensor, root_name: str, root: int
    ) -> list[list[torch.Tensor]]:
        """The per-rank list that only the root passes (gather_list, scatter_list)."""
        if self.rank == root:
            if tensors is None:
                raise ValueError(f"{name} is required on rank {root_name}={root}")
            return [self._check_list(name, tensors, like, "tensor")]
        if tensors:
            raise ValueError(f"{name} must be None or empty on ranks other than {root_name}={root}")
        return []

    def _cached(self, key: tuple[object, ...], build: Callable[[], Any]) -> Any:
        options = self._options.get(key)
        if options is None:
            options = self._options[key] = build()
        return options

    def _reduce_opts(self, kind: str, factory: Callable[[], Any], op: AnyReduceOp, root: int | None = None) -> Any:
        if type(op) is ReduceOp:  # the usual case, first: no isinstance on torch's types
            options = self._options.get((kind, op, root))
            if options is not None:
                return options
        # A ReduceOp instance (not its enum) may carry a factor (PREMUL_SUM): never shared.
        shared = not isinstance(op, TorchReduceOp) or isinstance(op, TorchReduceOp.RedOpType)
        if shared:
            try:
                options = self._options.get((kind, op, root))
            except TypeError:  # unhashable: not a ReduceOp; _reduce_op_name says so
                shared = False
            else:
                if options is not None:
                    return options
        name = _reduce_op_name(op)
        self._driver.check_reduce_op(kind, name)
        options = factory()
        options.reduceOp = getattr(TorchReduceOp, name) if shared else op
        if root is not None:
            options.rootRank, options.rootTensor = root, 0
        if shared:
            self._options[(kind, op, root)] = options
        return options

    def _rooted_opts(self, kind: str, factory: Callable[[], Any], root: int) -> Any:
        options = self._options.get((kind, root))
        if options is None:
            options = self._options[(kind, root)] = factory()
            options.rootRank = root
            if hasattr(options, "rootTensor"):
                options.rootTensor = 0
        return options

    # -- running ops -------------------------------------------------------------------

    def _not_started(self, op: str, exc: Exception, args: tuple[Any, ...]) -> BaseException:
        """What to raise when the communicator refused to start an op."""
        if self._error is not None:
            return self._error.fresh()  # released under the caller's feet
        if op in self._driver.self_checked:
            ARGUMENT_CHECKS[op](self, args)  # names what the backend refused
        if not isinstance(exc, RuntimeError):
            return exc
        if _lost_peer(exc):
            return self._in_flight.op_failed(op, exc).fresh()
        if says_unsupported(str(exc)):
            return UnsupportedOpError(op, self._driver.name, short(exc))
        return exc

    def _failed(self, op: str, exc: Exception, args: tuple[Any, ...], started: bool) -> BaseException:
        """What to raise when `op` with `args` was refused (not started) or failed while it ran
        (which breaks the world)."""
        if started:
            return self._in_flight.op_failed(op, exc).fresh()
        return self._not_started(op, exc, args)

    def _run(self, op: str, args: tuple[Any, ...], async_op: bool) -> Work | None:
        """Start `op` with `args` on the communicator (see _METHODS).

        This runs as little Python as it can, and takes no lock: on two busy cores every line
        here showed in bench/collectives.py. A broken world's _post raises its error. A blocking
        caller waits itself, with no thread handoff; a verdict on the world frees it through the
        driver's interrupt (see World._break). Its op metrics cost one None check each way
        while this process serves none."""
        recorder = self._recorder
        started = recorder.issued(op) if recorder is not None else 0.0
        torch_work = None
        try:
            torch_work = self._post[op](*args)
            if not async_op:
                torch_work.wait()
                if recorder is not None:
                    recorder.done(op, started)
                return None
        except (RuntimeError, TypeError) as exc:
            raise self._failed(op, exc, args, torch_work is not None) from exc
        work = Work(self._in_flight, op, torch_work, started)
        # _refuse sets _error before it takes the works in flight: a work it missed sees the
        # error here and fails itself.
        self._in_flight.works.add(work)
        if self._error is not None:
            work.settle(self._error)
        elif op in self._driver.waited_ops:
            assert self._waiters is not None
            self._waiters.submit(work)
        else:
            self._driver.track(torch_work, work)
        return work

    # -- point to point ----------------------------------------------------------------
    # send and recv run their blocking path in their own frame instead of calling
    # _run: a ping-pong puts two of them on its critical path, and a second frame for each was a
    # large part of the library's own share of a ping-pong's time (bench/collectives.py,
    # send_recv).

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, async_op: bool = False) -> Work | None:
        """Send `tensor` to rank `dst` of this world."""
        if type(dst) is not int or dst not in self._peers:
            self._check_rank("dst", dst, peer=True)
        if self._device is not None:
            _check_tensor("tensor", tensor, self._device)
        if async_op:
            return self._run("send", ([tensor], dst, tag), True)
        # _run's blocking path, inlined (see the note above send).
        recorder = self._recorder
        started = recorder.issued("send") if recorder is not None else 0.0
        work = None
        try:
            work = self._post["send"]([tensor], dst, tag)
            work.wait()
        except (RuntimeError, TypeError) as exc:
            raise self._failed("send", exc, ([tensor], dst, tag), work is not None) from exc
        if recorder is not None:
            recorder.done("send", started)
        return None

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, async_op: bool = False) -> Work | None:
        """Receive into `tensor` from rank `src` of this world."""
        if type(src) is not int or src not in self._peers:
            self._check_rank("src", src, peer=True)
        if self._device is not None:
            _check_tensor("tensor", tensor, self._device)
        if async_op:
            return self._run("recv", ([tensor], src, tag), True)
        # _run's blocking path, inlined (see the note above send).
        recorder = self._recorder
        started = recorder.issued("recv") if recorder is not None else 0.0
        work = None
        try:
            work = self._post["recv"]([tensor], src, tag)
            work.wait()
        except (RuntimeError, TypeError) as exc:
            raise self._failed("recv", exc, ([tensor], src, tag), work is not None) from exc
        if recorder is not None:
            recorder.done("recv", started)
        return None

    # -- collectives -------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work | None:
        """Copy rank `src`'s `tensor` into every other rank's `tensor`."""
        if type(tensor) is not Tensor or self._device is not None or not tensor.is_contiguous():
            _check_tensor("tensor", tensor, self._device)
        if type(src) is not int or src not in self._ranks:
            self._check_rank("src", src)
        options = self._rooted_opts("broadcast", BroadcastOptions, src)
        return self._run("broadcast", ([tensor], options), async_op)

    def all_reduce(self, tensor: torch.Tensor, op: AnyReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce `tensor` over every rank with `op`; every rank's `tensor` holds the result."""
        if type(tensor) is not Tensor or self._device is not None or not tensor.is_contiguous():
            _check_tensor("tensor", tensor, self._device)
        options = self._reduce_opts("all_reduce", AllreduceOptions, op)
        return self._run("all_reduce", ([tensor], options), async_op)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: AnyReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """Only rank `dst` is guaranteed to hold the result; other ranks' tensors are scratch."""
        if type(tensor) is not Tensor or self._device is not None or not tensor.is_contiguous():
            _check_tensor("tensor", tensor, self._device)
        self._check_rank("dst", dst)
        options = self._reduce_opts("reduce", ReduceOptions, op, root=dst)
        return self._run("reduce", ([tensor], options), async_op)

    def all_gather(
        self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """Every rank's `tensor` into every rank's `tensor_list` (one tensor per rank, in rank order)."""
        args = ([tensor_list], [tensor], self._cached(("all_gather",), AllgatherOptions))
        if "all_gather" not in self._driver.self_checked:
            _check_all_gather(self, args)
        return self._run("all_gather", args, async_op)

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: Sequence[torch.Tensor] | None = None,
        dst: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        """Every rank's `tensor` into rank `dst`'s `gather_list` (one per rank; None on the others)."""
        _check_tensor("tensor", tensor, self._device)
        self._check_rank("dst", dst)
        outputs = self._root_list("gather_list", gather_list, tensor, "dst", dst)
        options = self._rooted_opts("gather", GatherOptions, dst)
        return self._run("gather", (outputs, [tensor], options), async_op)

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: Sequence[torch.Tensor] | None = None,
        src: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        """Rank `src`'s `scatter_list[i]` into rank i's `tensor` (`scatter_list`: None on the others)."""
        _check_tensor("tensor", tensor, self._device)
        self._check_rank("src", src)
        inputs = self._root_list("scatter_list", scatter_list, tensor, "src", src)
        options = self._rooted_opts("scatter", ScatterOptions, src)
        return self._run("scatter", ([tensor], inputs, options), async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: AnyReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce every rank's `input_list[i]` with `op` into rank i's `output`."""
        _check_tensor("output", output, self._device)
        inputs = self._check_list("input_list", input_list, output, "output")
        options = self._reduce_opts("reduce_scatter", ReduceScatterOptions, op)
        return self._run("reduce_scatter", ([output], [inputs], options), async_op)

    def all_to_all(
        self,
        output_tensor_list: Sequence[torch.Tensor],
        input_tensor_list: Sequence[torch.Tensor],
        async_op: bool = False,
    ) -> Work | None:
        """Rank i sends input_tensor_list[j] to rank j, which receives it in output_tensor_list[i]."""
        outputs = self._check_list("output_tensor_list", output_tensor_list, None, "")
        inputs = self._check_list("input_tensor_list", input_tensor_list, None, "")
        for i, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
            if out.dtype != inp.dtype:
                raise ValueError(
                    f"output_tensor_list[{i}] has dtype {out.dtype}, but input_tensor_list[{i}] has {inp.dtype}"
                )
        options = self._cached(("all_to_all",), AllToAllOptions)
        return self._run("all_to_all", (outputs, inputs, options), async_op)

    def barrier(self, async_op: bool = False) -> Work | None:
        """Until every rank of the world has called it."""
        options = self._cached(("barrier",), self._driver.barrier_options)
        return self._run("barrier", (options,), async_op)
