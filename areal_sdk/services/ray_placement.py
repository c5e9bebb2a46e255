"""Where ``run.placement: ray`` puts each service: the cluster connection, the optional
placement group, and the Ray options of one engine server or rollout worker actor.

``ray.strategy`` set: one placement group reserves a bundle per engine server and per
rollout worker (each the kind's ``ray.<kind>`` resources) with that strategy, before any
actor starts, so a cluster that cannot hold the run fails it at once. An actor that replaces
a dead one goes back into its bundle, which Ray moves to a live node when its node left.
Without a strategy each actor asks for its kind's resources alone; custom resources pin a
kind to the nodes that declared them (``ray start --resources='{"engine_node": 4}'``).

>>> placement = RayPlacement(cfg).connect()                     # doctest: +SKIP
>>> placement.reserve(engines=2, workers=4)                     # doctest: +SKIP
>>> ServerActor.options(**placement.options("engine", 0)).remote()  # doctest: +SKIP
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_sdk.config import Config, RayResources
from areal_sdk.launcher import LaunchError

log = logging.getLogger(__name__)

Kind = Literal["engine", "worker"]

# ``ray.init`` runs on this one thread, which lives as long as the process. A local cluster's
# head processes (GCS, raylet) are started with ``PR_SET_PDEATHSIG``, which kills them when
# the *thread* that forked them exits: started from a short-lived thread (the run builds its
# trainer on one), the cluster died seconds later.
_RAY_INIT_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="areal-ray-init")


@dataclass(frozen=True)
class NodeInfo:
    """Where an actor landed."""

    node_id: str
    ip: str

    @classmethod
    def here(cls) -> NodeInfo:
        """The node of the calling actor."""
        return cls(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())

    def __str__(self) -> str:
        return f"node {self.node_id[:12]} ({self.ip})"


def first_line(exc: BaseException) -> str:
    """A Ray error's first line (the rest is a remote traceback), for one-line messages."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_reachable(address: str | None, timeout_s: float = 10.0) -> tuple[str, str] | None:
    """Fail at once on a head that does not answer: ``ray.init`` retries one for good. With
    no address, Ray joins ``RAY_ADDRESS`` or the cluster ``ray start`` recorded here, which
    may have stopped since. Returns the head's ``host:port`` and how to name it, or None
    where Ray starts a cluster or connects otherwise (``ray://``)."""
    where = f"ray.address={address}"
    if address is None or address == "auto":
        address = os.environ.get("RAY_ADDRESS") or _recorded_cluster()
        where = f"the Ray cluster at {address} (RAY_ADDRESS or the last `ray start` here)"
    if address is None or address == "auto" or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise LaunchError(
            f"cannot connect to {where}: {exc}; start it, set ray.address, or `ray stop` to "
            "forget a stopped one"
        ) from None
    return address, where


def _asks_for_a_token(address: str, timeout_s: float = 5.0) -> bool | None:
    """Whether the head at ``address`` refuses a caller without Ray's authentication token
    (one RPC that needs nothing else); None where that cannot be told."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return None
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return True if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return False


def _authenticate_as_the_head_asks(address: str, where: str) -> None:
    """Join with a token exactly where the head asks for one, unless ``RAY_AUTH_MODE`` says
    otherwise. ``ray start --head`` turns token authentication on wherever it finds a token
    (any earlier local ``ray.init`` writes ``~/.ray/auth_token``), but a driver given an
    explicit address sends none and is refused after 20 s of retries; a driver that sends
    one to a cluster without authentication connects, but its actors die at once."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    asks = _asks_for_a_token(address)
    if asks is None:
        return
    if not asks:
        os.environ["RAY_AUTH_MODE"] = "disabled"  # also where a token lies here
        return
    if not _token_here():
        raise LaunchError(
            f"cannot connect to {where}: the cluster uses token authentication and this "
            "machine has no token; set RAY_AUTH_TOKEN to the head's (`ray get-auth-token` "
            "there) or copy its ~/.ray/auth_token here"
        )
    try:  # what Ray itself does for a cluster it finds without an address
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # moved in another Ray: the variable alone, read when Ray starts
        os.environ["RAY_AUTH_MODE"] = "token"
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _token_here() -> bool:
    """Whether this machine holds a Ray authentication token, where Ray looks for one."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return os.path.isfile(path)


def _recorded_cluster() -> str | None:
    try:
        from ray._private.utils import read_ray_address
    except ImportError:  # moved in another Ray: ray.init looks it up itself
        return None
    return read_ray_address()


def reachable_addr(addr: str) -> str:
    """``addr``, an address of this node, as actors on other nodes dial it: a loopback or
    wildcard one (or ``localhost``) becomes this node's IP as Ray picks it."""
    if addr == "localhost":
        return ray.util.get_node_ip_address()
    try:
        ip = ipaddress.ip_address(addr.strip("[]"))
    except ValueError:
        return addr  # a host name: the user's choice
    return ray.util.get_node_ip_address() if ip.is_loopback or ip.is_unspecified else addr


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RayPlacement:
    """The run's connection to its Ray cluster and the options of each actor it places."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.group: PlacementGroup | None = None
        self._offsets: dict[Kind, tuple[int, int]] = {}  # kind -> (first bundle, count)
        self._connected_here = False

    def connect(self, *, engines: int, workers: int) -> RayPlacement:
        """Join the configured cluster, or start a local one that holds ``engines`` engine
        servers and ``workers`` rollout workers; raise ``LaunchError`` saying which address
        failed."""
        if ray.is_initialized():
            return self
        address = self.cfg.ray.address
        if (head := _check_reachable(address)) is not None:
            _authenticate_as_the_head_asks(*head)
        local: dict[str, Any] = {}
        if address is None and not os.environ.get("RAY_ADDRESS") and _recorded_cluster() is None:
            # A cluster of this machine alone: its CPUs are logical, shared by every service
            # as under `processes` (a two-core machine still runs two workers and an engine).
            ray_cfg = self.cfg.ray
            asked = engines * ray_cfg.engine.num_cpus + workers * ray_cfg.worker.num_cpus
            asked += ray_cfg.trainer.ranks * ray_cfg.trainer.num_cpus
            local = {
                "num_cpus": max(os.cpu_count() or 1, math.ceil(asked)),
                "include_dashboard": False,
            }
        try:
            _RAY_INIT_THREAD.submit(
                ray.init,
                address=address,
                namespace=self.cfg.ray.namespace,
                log_to_driver=False,  # each service logs to run.dir/services/<name>.log
                **local,
            ).result()
        except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
            where = f"ray.address={address}" if address else "the local Ray cluster"
            raise LaunchError(f"cannot connect to {where}: {first_line(exc)}") from None
        self._connected_here = True
        return self

    def resources(self, kind: Kind) -> dict[str, float]:
        """What one service of ``kind`` asks for, in Ray's resource names (zeros left out)."""
        ask = self._ask(kind)
        out = {"CPU": ask.num_cpus, "GPU": self._gpus(kind), **ask.resources}
        return {name: amount for name, amount in out.items() if amount}

    def reserve(self, *, engines: int, workers: int, timeout_s: float) -> None:
        """With ``ray.strategy``: one placement group for every engine and worker, ready
        within ``timeout_s`` or a ``LaunchError`` naming what the cluster lacks."""
        strategy = self.cfg.ray.strategy
        if strategy is None:
            return
        bundles = [self.resources("engine")] * engines + [self.resources("worker")] * workers
        self._offsets = {"engine": (0, engines), "worker": (engines, workers)}
        self.group = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            available = ray.available_resources()
            raise LaunchError(
                f"the Ray cluster could not reserve {engines} engine bundle(s) of "
                f"{self.resources('engine')} and {workers} rollout worker bundle(s) of "
                f"{self.resources('worker')} with ray.strategy={strategy} within "
                f"{timeout_s:g} s (available now: {available}); add nodes, lower "
                "ray.engine / ray.worker, or choose a softer strategy"
            ) from None

    def options(self, kind: Kind, index: int) -> dict[str, Any]:
        """``.options(...)`` for service ``index`` of ``kind``: its bundle of the placement
        group when it has one (an added engine beyond the reserved ones has none)."""
        ask = self._ask(kind)
        options: dict[str, Any] = {
            "num_cpus": ask.num_cpus,
            "num_gpus": self._gpus(kind),
            "resources": dict(ask.resources),
            "max_restarts": 0,  # the run replaces a dead actor itself, within its budget
        }
        first, count = self._offsets.get(kind, (0, 0))
        if self.group is not None and index < count:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=first + index
            )
        return options

    def machines(self) -> set[str]:
        """The IPs of the cluster's live nodes (several nodes may share one machine)."""
        return {node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}

    def close(self) -> None:
        """Release the placement group and leave the cluster (a cluster this run started
        stops with it; one it joined goes on)."""
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception as exc:  # the cluster went away first
                log.debug("could not remove the placement group: %s", exc)
            self.group = None
        if self._connected_here and ray.is_initialized():
            ray.shutdown()
            self._connected_here = False

    def _ask(self, kind: Kind) -> RayResources:
        return self.cfg.ray.engine if kind == "engine" else self.cfg.ray.worker

    def _gpus(self, kind: Kind) -> float:
        gpus = self._ask(kind).num_gpus
        if gpus is not None:
            return gpus
        return 1.0 if kind == "engine" and self.cfg.inference.device.startswith("cuda") else 0.0
