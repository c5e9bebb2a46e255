"""Trainer ranks on a Ray cluster: one actor per rank, together one ``torch.distributed``
group (gloo on CPU, NCCL on CUDA), seen by the training loop as one ``TrainBackend``.

```
 run process (training loop, weight pushes)
   RayTrainGroup ──► rank 0 actor ─┐  one torch.distributed group:
                 ──► rank 1 actor ─┤  DeepSpeed ZeRO 0-3 collectives
                 ──► rank N actor ─┘  (every call runs on every rank)
```

Each rank asks for ``ray.trainer``'s resources (a bundle of its own in a placement group
with ``ray.strategy``, PACK by default: the ranks start together or not at all). Rank 0's
actor names its node's IP and a free port; every actor then sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` and builds ``train.backend``, which joins
the group. The loop packs ``world_size`` equal shares of micro-batches, rank-major
(``pack_samples(..., num_ranks=world_size)``); each call sends every rank its share at once
and returns rank 0's answer. Weight buckets are gathered on every rank (ZeRO-3) and rank 0's
come back to the run, which pushes them to the engines as under one rank.

A rank whose actor dies, or whose node leaves, ends the group: its peers wait in a collective
that will never complete, so every actor is killed and the call (or the trainer watch, when
no call is running) fails with ``TrainGroupError`` naming the rank and its node. The run then
stops with one ``error:`` line; ``--resume`` continues from the last checkpoint. Every wait
watches the actors, so nothing hangs on a lost rank.

>>> backend = RayTrainGroup(cfg)              # doctest: +SKIP
>>> backend.train_step(rank_major_batches, loss_fn)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_sdk.launcher import LaunchError
from areal_sdk.services.ray_placement import NodeInfo, RayPlacement, first_line, free_port
from areal_sdk.train_backend import LossFn, NamedTensors, TrainBackend
from areal_sdk.train_process import (
    RemoteBackend,
    SharedBucket,
    TrainProcessError,
    open_bucket,
    share_bucket,
)

if TYPE_CHECKING:
    from areal_sdk.config import Config
    from areal_sdk.packing import MicroBatch

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a waiting call checks that every rank lives
_START_TIMEOUT_S = 600.0
# After one rank fails a call its peers may be waiting in a collective that will not
# complete: this long for them to finish, then the group is stopped.
_PEERS_GRACE_S = 30.0
_CLOSE_TIMEOUT_S = 30.0


class TrainGroupError(TrainProcessError):
    """A trainer rank died or its node left; or the group could not start or go on."""


# What a rank's actor forwards to its backend as it is.
_FORWARDED = frozenset({"forward_logprobs", "train_step", "save", "load", "save_adapter"})


@ray.remote(concurrency_groups={"watch": 1})
class TrainRankActor:
    """One trainer rank: the configured backend, one call at a time; ``lifeline`` answers
    only when the actor closes, so the run sees a death as soon as Ray does."""

    def __init__(self, log_path: str) -> None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for fd in (1, 2):  # DeepSpeed and torch print: into the run's service log
            os.dup2(out, fd)
        os.close(out)
        logging.basicConfig(
            stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
        )
        self.backend: TrainBackend | None = None
        self.sync_dtype: torch.dtype | None = None
        # weights.method cuda_ipc: rank 0 hands its buckets to the run's process on this
        # node as CUDA IPC handles instead of copies through Ray.
        self.share_on_node = False
        self.reads: dict[int, Iterator[NamedTensors]] = {}
        self.read_ids = itertools.count()
        self.closed = threading.Event()

    def where(self) -> dict[str, Any]:
        """This rank's node, a port free there (rank 0's is the group's), its GPUs."""
        node = NodeInfo.here()
        return {
            "node_id": node.node_id,
            "ip": node.ip,
            "port": free_port(node.ip),
            "pid": os.getpid(),
            "gpus": len(ray.get_gpu_ids()),
        }

    def start(self, config: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        """Join the group and build the backend (every rank at once: a collective)."""
        os.environ.update(env)
        from areal_sdk.backends.weight_sync.base import sync_dtype
        from areal_sdk.config import Config
        from areal_sdk.plugin_host import get_host

        cfg = Config.model_validate(config)
        self.backend = get_host().train_backend(cfg.train.backend)(cfg)
        self.sync_dtype = sync_dtype(cfg.weights.dtype)
        self.share_on_node = cfg.weights.method == "cuda_ipc"
        return self.state()

    def state(self) -> dict[str, Any]:
        b = self.backend
        assert b is not None, "start first"
        return {
            "step": b.step,
            "initial_version": b.initial_version,
            "device": str(b.device),
            "trains_adapter": b.trains_adapter,
            "micro_batch_tokens": b.micro_batch_tokens,
        }

    def call(self, op: str, args: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]:
        """``op`` on this rank's backend: its result and the backend's state after."""
        b = self.backend
        assert b is not None, "start first"
        result: Any = None
        if op in _FORWARDED:
            result = getattr(b, op)(*args)
        elif op == "set_initial_version":
            (b.initial_version,) = args
        elif op == "sync_begin":
            # Reads by id: a push and an engine's catch-up may read at once (train_process).
            result = next(self.read_ids)
            self.reads[result] = iter(b.state_for_sync(*args))
        elif op == "sync_next":
            result = self._next_bucket(b, *args)
        elif op == "sync_end":
            self.reads.pop(args[0], None)
            if self.share_on_node and torch.cuda.is_available():
                torch.cuda.ipc_collect()  # free the buckets the run's process has released
        else:
            raise ValueError(f"unknown trainer rank request {op!r}")
        return result, self.state()

    def _next_bucket(
        self, b: TrainBackend, read: int
    ) -> tuple[bool, NamedTensors | SharedBucket | None]:
        """(whether there was a bucket, rank 0's copy of it, or its handle with
        ``share_on_node``): every rank gathers."""
        from areal_sdk.backends.weight_sync.base import cast_bucket

        buckets = self.reads.get(read)
        if buckets is None:
            raise RuntimeError("sync_next without sync_begin")
        bucket = next(buckets, None)
        if bucket is None:
            del self.reads[read]
            return False, None
        if b.rank != 0:
            return True, None
        if self.share_on_node:
            return True, share_bucket(bucket, self.sync_dtype)
        return True, [(n, t.detach().cpu()) for n, t in cast_bucket(bucket, self.sync_dtype)]

    def close(self) -> None:
        try:
            if self.backend is not None:
                self.backend.close()
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
        finally:
            self.closed.set()

    @ray.method(concurrency_group="watch")
    def lifeline(self) -> None:
        self.closed.wait()


def trainer_resources(cfg: Config) -> dict[str, float]:
    """What one trainer rank asks of the cluster, in Ray's resource names (zeros left out)."""
    ask = cfg.ray.trainer
    gpus = ask.num_gpus
    if gpus is None:
        gpus = 1.0 if cfg.train.device.startswith("cuda") else 0.0
    out = {"CPU": ask.num_cpus, "GPU": gpus, **ask.resources}
    return {name: amount for name, amount in out.items() if amount}


def _portable(cfg: Config) -> dict[str, Any]:
    """The config as the actors read it: paths absolute (an actor's working directory is
    not the run's; the run directory and the model are on a shared path), and a ``cuda:N``
    device ``cuda`` where Ray gives each rank its cards (they are the ones it sees)."""
    data = cfg.model_dump(mode="json")
    for section, key in (("model", "path"), ("model", "tokenizer"), ("run", "dir")):
        value = data[section][key]
        if value and (section == "run" or Path(value).exists()):
            data[section][key] = str(Path(value).resolve())
    if trainer_resources(cfg).get("GPU") and data["train"]["device"].startswith("cuda:"):
        data["train"]["device"] = "cuda"
    return data


class RayTrainGroup(RemoteBackend):
    """``ray.trainer.ranks`` actors running ``cfg.train.backend`` as one group (module doc).

    Calls are serialised (one at a time, from any thread) and block the calling thread.
    ``nodes[r]`` is where rank ``r`` runs."""

    def __init__(
        self,
        cfg: Config,
        *,
        start_timeout_s: float = _START_TIMEOUT_S,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.on_event = on_event or (lambda message: log.info(message))
        self.ranks = cfg.ray.trainer.ranks
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {}
        self._closed = False
        self._closing = False
        self._failure: str | None = None
        self._actors: list[Any] = []
        self._lifelines: list[ray.ObjectRef] = []
        self.nodes: list[NodeInfo] = []
        self.pids: list[int] = []
        self.placement = RayPlacement(cfg).connect(
            engines=cfg.inference.servers, workers=cfg.rollout.workers
        )
        try:
            self._start(start_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- start -----------------------------------------------------------------------------

    def _start(self, timeout_s: float) -> None:
        bundle = trainer_resources(self.cfg)
        if not bundle:
            raise LaunchError(
                "ray.trainer asks for nothing, and each trainer rank needs a placement group "
                "bundle: give it num_cpus, num_gpus or resources"
            )
        strategy = self.cfg.ray.strategy or "PACK"
        self._group = placement_group([bundle] * self.ranks, strategy=strategy)
        try:
            ray.get(self._group.ready(), timeout=timeout_s)
        except GetTimeoutError:
            raise LaunchError(
                f"the Ray cluster could not reserve {self.ranks} trainer rank bundle(s) of "
                f"{bundle} with strategy {strategy} within {timeout_s:g} s (available now: "
                f"{ray.available_resources()}); add nodes or lower ray.trainer"
            ) from None
        log_dir = Path(self.cfg.run.dir).resolve() / "services"
        ask = self.cfg.ray.trainer
        for rank in range(self.ranks):
            self._actors.append(
                TrainRankActor.options(
                    num_cpus=ask.num_cpus,
                    num_gpus=bundle.get("GPU", 0.0),
                    resources=dict(ask.resources),
                    max_restarts=0,  # a rank cannot rejoin its group: the run stops
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._group, placement_group_bundle_index=rank
                    ),
                ).remote(str(log_dir / f"trainer-{rank}.log"))
            )
        self._lifelines = [actor.lifeline.remote() for actor in self._actors]
        where = self._all("start", [a.where.remote() for a in self._actors], timeout_s)
        self.nodes = [NodeInfo(w["node_id"], w["ip"]) for w in where]
        self.pids = [int(w["pid"]) for w in where]
        master = where[0]
        config = _portable(self.cfg)
        starts = []
        for rank, (actor, here) in enumerate(zip(self._actors, where, strict=True)):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.ranks),
                # Ray gives a GPU actor its cards alone: its first visible card is its own.
                "LOCAL_RANK": "0" if here["gpus"] else str(self._index_on_node(rank)),
                "MASTER_ADDR": str(master["ip"]),
                "MASTER_PORT": str(master["port"]),
            }
            if not self.cfg.train.device.startswith("cuda"):
                env["DS_ACCELERATOR"] = "cpu"  # read once, when DeepSpeed is imported
            starts.append(actor.start.remote(config, env))
            self.on_event(
                f"trainer rank {rank} starts on {self.nodes[rank]}, pid {self.pids[rank]}"
            )
        self._state = self._all("start", starts, timeout_s)[0]

    def _index_on_node(self, rank: int) -> int:
        return sum(1 for r in range(rank) if self.nodes[r].node_id == self.nodes[rank].node_id)

    # -- calls -----------------------------------------------------------------------------

    def _where(self, rank: int) -> str:
        return f"trainer rank {rank}" + (f" on {self.nodes[rank]}" if self.nodes else "")

    def _all(self, op: str, refs: list[ray.ObjectRef], timeout_s: float | None = None) -> list[Any]:
        """Every rank's answer to ``op``, watching the actors while they work."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        failed: tuple[int, RayTaskError] | None = None
        failed_at = 0.0
        started = time.monotonic()
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as exc:
                    raise self._died(rank, op, exc) from None
                except RayTaskError as exc:
                    if failed is None:
                        failed, failed_at = (rank, exc), time.monotonic()
            self._check_lifelines(op)
            now = time.monotonic()
            if pending and failed is not None and now - failed_at > _PEERS_GRACE_S:
                rank, exc = failed
                self._stop_group(f"{self._where(rank)} failed {op}: {first_line(exc)}")
                raise TrainGroupError(
                    f"{self._where(rank)} failed {op} ({first_line(exc)}) and the other ranks "
                    "could not finish it; the trainer was stopped"
                ) from exc
            if pending and timeout_s is not None and now - started > timeout_s:
                self._stop_group(f"{op} took over {timeout_s:g} s")
                raise TrainGroupError(f"the trainer ranks did not {op} within {timeout_s:g} s")
        if failed is not None:  # every rank answered: the group can go on
            _, exc = failed
            cause = exc.cause if isinstance(exc.cause, BaseException) else None
            raise (cause or TrainGroupError(f"{op} failed: {first_line(exc)}")) from exc
        return results

    def _check_lifelines(self, op: str) -> None:
        if self._closing:
            return  # a closed actor's lifeline answers
        if self._failure is not None:
            raise TrainGroupError(self._failure)
        dead, _ = ray.wait(self._lifelines, num_returns=len(self._lifelines), timeout=0)
        if dead:
            rank = self._lifelines.index(dead[0])
            try:
                ray.get(dead[0])
                why: BaseException = RuntimeError("its actor exited")
            except RayError as exc:
                why = exc
            raise self._died(rank, op, why)

    def _died(self, rank: int, op: str, exc: BaseException) -> TrainGroupError:
        message = f"{self._where(rank)} died during {op}: {first_line(exc)}"
        self._stop_group(message)
        return TrainGroupError(message)

    def _stop_group(self, why: str) -> None:
        """Kill every rank (peers of a lost rank wait in a collective that never ends)."""
        if self._failure is None:
            self._failure = why
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # gone already, or the cluster is
                log.debug("could not kill a trainer rank: %s", exc)

    def _call(self, op: str, *args: Any) -> Any:
        """``op`` with the same ``args`` on every rank; rank 0's result."""
        return self._call_each(op, [args] * self.ranks)[0]

    def _call_each(self, op: str, args: list[tuple[Any, ...]]) -> list[Any]:
        with self._lock:
            if self._closed:
                raise TrainGroupError(f"{op}: the trainer group is closed")
            if self._failure is not None:
                raise TrainGroupError(self._failure)
            refs = [a.call.remote(op, a_args) for a, a_args in zip(self._actors, args, strict=True)]
            answers = self._all(op, refs)
            self._state = answers[0][1]
            return [result for result, _ in answers]

    def failure(self) -> str | None:
        """Why the group cannot go on (a rank died, its node left), else None; checked by
        the run's trainer watch between calls."""
        if self._failure is None and not self._closed:
            with contextlib.suppress(TrainGroupError):  # recorded in _failure
                self._check_lifelines("training")
        return self._failure

    def _shares(self, batches: list[MicroBatch]) -> list[tuple[Any, ...]]:
        """The rank-major micro-batches as each rank's share."""
        if len(batches) % self.ranks:
            raise ValueError(
                f"{len(batches)} micro-batches do not split evenly over {self.ranks} trainer "
                "ranks: pack with pack_samples(..., num_ranks=world_size)"
            )
        per = len(batches) // self.ranks
        return [(batches[r * per : (r + 1) * per],) for r in range(self.ranks)]

    # -- TrainBackend ----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.ranks

    def forward_logprobs(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Every rank's logprobs, back in the order of ``batches``."""
        per_rank = self._call_each("forward_logprobs", self._shares(batches))
        return [lp for share in per_rank for lp in share]

    def train_step(self, batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """One step over rank-major ``batches``; the metrics of the whole step (rank 0's)."""
        shares = [(*share, loss_fn) for share in self._shares(batches)]
        return self._call_each("train_step", shares)[0]  # type: ignore[no-any-return]

    def state_for_sync(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """Rank 0's buckets, every rank gathering each one (a collective under ZeRO-3)."""
        read = self._call("sync_begin", bucket_bytes)
        try:
            while True:
                more, bucket = self._call("sync_next", read)
                if not more:
                    return
                yield open_bucket(bucket) if self.cfg.weights.method == "cuda_ipc" else bucket
        finally:
            if not self._closed and self._failure is None:
                self._call("sync_end", read)

    def save(self, directory: str | Path) -> None:
        self._call("save", str(Path(directory).resolve()))

    def load(self, directory: str | Path) -> None:
        self._call("load", str(Path(directory).resolve()))

    def save_adapter(self, directory: str | Path) -> Path:
        self._call("save_adapter", str(Path(directory).resolve()))
        return Path(directory)

    def close(self) -> None:
        """Close every rank together (the backends leave the group as one), then release the
        placement group and, if this run started Ray, Ray."""
        alive = self._actors and self._failure is None and not self._closed
        if alive and self._lock.acquire(timeout=_CLOSE_TIMEOUT_S):
            self._closing = True
            try:
                self._all("close", [a.close.remote() for a in self._actors], _CLOSE_TIMEOUT_S)
            except (TrainProcessError, RayError) as exc:
                log.warning("the trainer ranks did not close cleanly: %s", exc)
            finally:
                self._lock.release()
        self._closed = True
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                log.debug("could not kill a trainer rank: %s", exc)
        self._actors = []
        group = getattr(self, "_group", None)
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception as exc:  # the cluster went away first
                log.debug("could not remove the trainer's placement group: %s", exc)
            self._group = None
        self.placement.close()
