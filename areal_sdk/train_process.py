"""A train backend in a process of its own (``train.separate_process: true``).

In one process the trainer shares the interpreter with the engine, the gateway and the
agents. Every torch call releases and retakes the GIL, and a thread that wants it back behind
a busy one waits up to the switch interval, so a GPU training step that takes 0.2 s alone
took 1.3-2.0 s beside generation (``benchmarks/README.md``). ``TrainProcess`` runs the
configured backend in a child process and forwards the ``TrainBackend`` calls to it over a
pipe: the child's Python stands alone between its kernel launches.

What crosses the pipe: micro-batches and the loss function (plain pickles; small), metrics
back. Plain, not ``multiprocessing``'s pickler: that one hands tensors over as shared memory
whose file descriptor the other side fetches from a helper thread, and a child killed while
fetching one left that thread printing a raw traceback in the parent;
for a weight push, one flat buffer per bucket shared by handle, not copied (CUDA IPC on a
GPU, shared memory on CPU), so the parent's weight sync reads the child's memory directly.
torch keeps a shared buffer alive while the parent still holds it.

The child loads the installed plugins (``get_host()``): a train backend registered only in
the parent's own host is not visible to it. A child that dies fails the call that was
waiting on it with ``TrainProcessError`` naming its exit code, never a hang.
"""

from __future__ import annotations

import abc
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from areal_sdk.train_backend import LossFn, NamedTensors, TrainBackend

if TYPE_CHECKING:
    from areal_sdk.config import Config
    from areal_sdk.packing import MicroBatch

log = logging.getLogger(__name__)

# How often a waiting call checks that the child still lives.
_POLL_S = 0.5
_START_TIMEOUT_S = 600.0


class TrainProcessError(RuntimeError):
    """The train process died, could not start, or failed a call it cannot report."""


class RemoteTraceback(Exception):
    """The child's traceback, chained under the exception it raised."""

    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return f"\n\nin the train process:\n{self.args[0]}"


# -- the child ---------------------------------------------------------------------------


class _Child:
    """The child's side: one backend, one request at a time."""

    def __init__(self, conn: Connection, backend: TrainBackend, sync_dtype: torch.dtype | None):
        self.conn = conn
        self.backend = backend
        self.sync_dtype = sync_dtype
        # Open weight reads by id: a push and an engine's catch-up may read at once, their
        # calls interleaved (one shared iterator gave one the other's end).
        self._reads: dict[int, Iterator[NamedTensors]] = {}
        self._read_ids = itertools.count()

    def state(self) -> dict[str, Any]:
        b = self.backend
        return {
            "step": b.step,
            "initial_version": b.initial_version,
            "device": str(b.device),
            "rank": b.rank,
            "world_size": b.world_size,
            "trains_adapter": b.trains_adapter,
            "micro_batch_tokens": b.micro_batch_tokens,
        }

    def handle(self, op: str, args: tuple[Any, ...]) -> Any:
        b = self.backend
        if op == "forward_logprobs":
            return b.forward_logprobs(*args)
        if op == "train_step":
            return b.train_step(*args)
        if op == "save":
            return b.save(*args)
        if op == "load":
            return b.load(*args)
        if op == "save_adapter":
            return b.save_adapter(*args)
        if op == "set_initial_version":
            (b.initial_version,) = args
            return None
        if op == "sync_begin":
            (bucket_bytes,) = args
            read = next(self._read_ids)
            self._reads[read] = iter(b.state_for_sync(bucket_bytes))
            return read
        if op == "sync_next":
            return self._next_bucket(*args)
        if op == "sync_end":
            self._reads.pop(args[0], None)
            if torch.cuda.is_available() and b.device.type == "cuda":
                torch.cuda.ipc_collect()  # free buckets the parent has released
            return None
        raise ValueError(f"unknown train process request {op!r}")

    def _next_bucket(self, read: int) -> SharedBucket | None:
        buckets = self._reads.get(read)
        if buckets is None:
            raise RuntimeError("sync_next without sync_begin")
        bucket = next(buckets, None)
        if bucket is None:
            del self._reads[read]
            return None
        return share_bucket(bucket, self.sync_dtype)

    def serve(self) -> None:
        while True:
            try:
                op, args = _receive_message(self.conn)
            except EOFError:
                return  # the parent is gone
            if op == "close":
                self.backend.close()
                _send_message(self.conn, ("ok", None, self.state()))
                return
            try:
                result = self.handle(op, args)
            except BaseException as exc:  # reported to the caller, the child serves on
                _send_message(self.conn, _error_reply(exc))
                continue
            _send_message(self.conn, ("ok", result, self.state()))


# A bucket as another process on this machine opens it: the handle of one flat buffer (CUDA
# IPC, or shared CPU memory) and each tensor's place in it (``TensorMeta.to_json``).
SharedBucket = tuple[bytes, list[list[object]]]


def share_bucket(bucket: NamedTensors, dtype: torch.dtype | None) -> SharedBucket:
    """``bucket`` (cast to ``dtype``) flattened into one buffer that another process on this
    machine opens without a copy: CUDA IPC for a GPU's, shared memory for the CPU's."""
    from areal_sdk.backends.weight_sync.base import cast_bucket, flatten_bucket
    from areal_sdk.backends.weight_sync.cuda_ipc import serialize_tensor

    flat, metas = flatten_bucket(cast_bucket(bucket, dtype))
    if flat.is_cuda:
        # The reader opens this memory from another process: no stream order there.
        torch.cuda.current_stream(flat.device).synchronize()
    else:
        flat.share_memory_()
    return serialize_tensor(flat), [m.to_json() for m in metas]


def open_bucket(shared: SharedBucket) -> NamedTensors:
    """The named tensors of a ``share_bucket`` from another process: views, no copy."""
    from areal_sdk.backends.weight_sync.base import TensorMeta, unflatten_bucket
    from areal_sdk.backends.weight_sync.cuda_ipc import deserialize_tensor

    payload, metas = shared
    return unflatten_bucket(deserialize_tensor(payload), [TensorMeta.from_json(m) for m in metas])


def _send_message(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive_message(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _error_reply(exc: BaseException) -> tuple[str, Any, str, str]:
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.dumps(exc)
        picklable: BaseException | None = exc
    except Exception:
        picklable = None
    return ("error", picklable, f"{type(exc).__name__}: {exc}", text)


def _child_main(conn: Connection, config: dict[str, Any]) -> None:
    from areal_sdk.backends.weight_sync.base import sync_dtype
    from areal_sdk.config import Config
    from areal_sdk.malloc import limit_arenas
    from areal_sdk.plugin_host import get_host

    # A terminal's Ctrl-C, a scheduler's SIGTERM (Slurm signals every process of a job step)
    # or `timeout` reach the whole process group; the parent finishes the step in flight and
    # checkpoints before it stops this process. A session of its own keeps those signals off
    # this process and its helpers (the compiler's workers); it still dies with the parent
    # (EOF on its pipe).
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    limit_arenas()
    try:
        cfg = Config.model_validate(config)
        backend = get_host().train_backend(cfg.train.backend)(cfg)
        child = _Child(conn, backend, sync_dtype(cfg.weights.dtype))
    except BaseException as exc:
        _send_message(conn, _error_reply(exc))
        return
    _send_message(conn, ("ok", None, child.state()))
    child.serve()


# -- the parent ----------------------------------------------------------------------------


class RemoteBackend(TrainBackend):
    """A ``TrainBackend`` whose backend runs elsewhere (a child process, Ray actors): the
    properties read the state it last reported, and calls go through ``_call``."""

    _state: dict[str, Any]

    @abc.abstractmethod
    def _call(self, op: str, *args: Any) -> Any:
        """Run ``op`` on the remote backend; its result."""

    @property
    def step(self) -> int:
        return int(self._state["step"])

    @property
    def initial_version(self) -> int:  # type: ignore[override]
        return int(self._state["initial_version"])

    @initial_version.setter
    def initial_version(self, version: int) -> None:
        self._call("set_initial_version", version)

    @property
    def device(self) -> torch.device:
        return torch.device(self._state["device"])

    @property
    def micro_batch_tokens(self) -> int:  # type: ignore[override]
        return int(self._state["micro_batch_tokens"])

    @property
    def trains_adapter(self) -> bool:
        return bool(self._state.get("trains_adapter", False))


class TrainProcess(RemoteBackend):
    """The ``TrainBackend`` of ``cfg.train.backend``, running in a spawned child process.

    Calls are serialised (one at a time, from any thread); each blocks its calling thread,
    never the GIL, while the child works.
    """

    def __init__(self, cfg: Config, *, start_timeout_s: float = _START_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(
            target=_child_main,
            args=(child_conn, cfg.model_dump(mode="json")),
            name=f"areal-train-{cfg.train.backend}",
            daemon=True,
        )
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {}
        self._closed = False
        self._closing = False  # close() was called: the child's exit is not a death
        self._process.start()
        child_conn.close()
        self._receive("start", timeout_s=start_timeout_s)
        if self.world_size != 1:
            self.close()
            raise TrainProcessError(
                "train.separate_process runs one trainer rank; the backend reports "
                f"{self.world_size} ranks"
            )

    # -- the protocol ----------------------------------------------------------------------

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self._closed:
                raise TrainProcessError(f"{op}: the train process is closed")
            try:
                _send_message(self._conn, (op, args))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise self._died(op) from None
            return self._receive(op)

    def _receive(self, op: str, timeout_s: float | None = None) -> Any:
        waited = 0.0
        while not self._conn.poll(_POLL_S):
            waited += _POLL_S
            if not self._process.is_alive():
                raise self._died(op)
            if timeout_s is not None and waited >= timeout_s:
                self._process.kill()
                raise TrainProcessError(f"the train process did not {op} within {timeout_s:g} s")
        try:
            reply = _receive_message(self._conn)
        except (EOFError, ConnectionResetError):
            raise self._died(op) from None
        if reply[0] == "error":
            _, exc, summary, text = reply
            if exc is None:
                exc = TrainProcessError(f"{op} failed in the train process: {summary}")
            raise exc from RemoteTraceback(text)
        _, result, state = reply
        self._state = state
        return result

    def _died(self, op: str) -> TrainProcessError:
        self._process.join(timeout=5)
        self._closed = True
        return TrainProcessError(
            f"the train process (pid {self._process.pid}) died during {op} "
            f"with exit code {self._process.exitcode}"
        )

    # -- TrainBackend ----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return int(self._state.get("rank", 0))

    @property
    def world_size(self) -> int:
        return int(self._state.get("world_size", 1))

    def exitcode(self) -> int | None:
        """None while the train process lives (or was closed on purpose); its exit code once
        it died."""
        if self._closing:
            return None
        return self._process.exitcode

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._process.pid

    def forward_logprobs(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        return self._call("forward_logprobs", batches)  # type: ignore[no-any-return]

    def train_step(self, batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        return self._call("train_step", batches, loss_fn)  # type: ignore[no-any-return]

    def state_for_sync(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The child's buckets as views of its shared buffers (cast to ``weights.dtype``)."""
        read = self._call("sync_begin", bucket_bytes)
        try:
            while True:
                reply = self._call("sync_next", read)
                if reply is None:
                    return
                yield open_bucket(reply)
        finally:
            if not self._closed:
                self._call("sync_end", read)

    def save(self, directory: str | Path) -> None:
        self._call("save", str(directory))

    def load(self, directory: str | Path) -> None:
        self._call("load", str(directory))

    def save_adapter(self, directory: str | Path) -> Path:
        return Path(self._call("save_adapter", str(directory)))

    def close(self) -> None:
        self._closing = True
        with self._lock:
            if not self._closed and self._process.is_alive():
                try:
                    _send_message(self._conn, ("close", ()))
                    self._receive("close", timeout_s=30)
                except (TrainProcessError, OSError, EOFError):
                    log.warning("the train process did not close cleanly; killing it")
            self._closed = True
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=5)
            self._conn.close()


def runs_apart(cfg: Config) -> bool:
    """Whether the train backend gets a process of its own (``train.separate_process``).

    Unset, a trainer on CUDA does: beside generation in the same interpreter a 0.17 s GRPO
    step took 1.8 s, apart 0.3 s (benchmarks/README.md). A rank of a multi-rank launch
    (``WORLD_SIZE`` > 1) stays in its process, and so does a CPU trainer (not measured apart:
    there the trainer and the engine share the same few cores either way)."""
    if cfg.train.separate_process is not None:
        return cfg.train.separate_process
    single_rank = int(os.environ.get("WORLD_SIZE", "1")) == 1
    return cfg.train.device.startswith("cuda") and single_rank


def build_train_backend(
    cfg: Config, host: Any, on_event: Callable[[str], None] | None = None
) -> TrainBackend:
    """``cfg.train.backend`` from ``host``: as Ray actors under ``run.placement: ray``, in
    a child process where ``runs_apart``."""
    if cfg.run.placement == "ray":
        # The run handles SIGINT and SIGTERM itself; read when Ray is imported (ray_stack.py).
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        from areal_sdk.services.ray_trainer import RayTrainGroup

        return RayTrainGroup(cfg, on_event=on_event)
    if runs_apart(cfg):
        return TrainProcess(cfg)
    return host.train_backend(cfg.train.backend)(cfg)  # type: ignore[no-any-return]
