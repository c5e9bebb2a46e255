"""The ``ray`` placement: engine servers and rollout workers as actors on a Ray cluster,
supervised as the ``processes`` placement supervises its processes.

```
 run process (this machine) ─ tasks ─► rollout worker actors ──HTTP──► gateway process ──► engine server actors
   controller, store, weight pushes,     on any node                  beside the store     on any node, each
   supervision                                                         (this machine)       bound to its node's IP
   RayTrainGroup ─► trainer rank actors on any node (``ray_trainer.py``, built before the stack)
```

The gateway stays beside the run's process: it writes every call to the trajectory store,
an SQLite file that must stay on one machine's disk. Weights reach the servers as
safetensors under the run directory, which every node must see at the same path (a shared
file system), or, with ``weights.method: broadcast``, over a process group whose rank 0 is
the run's process at this node's IP (``placement.py``). Everything else is
``ProcessStack``'s: the same watch loops, restart policy and ``ServiceFailed``.

>>> stack = await RayStack(cfg, store, host=host, address=address, run_dir=run_dir,
...     search_path=[config_dir]).start()                    # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from typing import Any

import httpx

from areal_sdk.services.stack import ProcessStack


class RayStack(ProcessStack):
    """``ProcessStack`` whose engine servers and rollout workers are Ray actors.

    ``nodes()`` maps each placed service's name to the node it runs on now."""

    placement: Any = None

    async def _start(self) -> None:
        # The run handles SIGINT and SIGTERM itself (the step in flight, a checkpoint); Ray's
        # handler would print a stack and abort the run instead. Read when Ray is imported.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        from areal_sdk.services.gateway_process import GatewayProcess
        from areal_sdk.services.ray_engines import RayEngineFleet
        from areal_sdk.services.ray_placement import RayPlacement
        from areal_sdk.services.ray_workers import RayWorkerPool

        cfg, beat = self.cfg, self.cfg.run.heartbeat_timeout_s
        servers, workers = cfg.inference.servers, cfg.rollout.workers
        where = cfg.ray.address or "the local Ray cluster"
        self.on_event(f"connecting to {where}")
        placement = RayPlacement(cfg)
        await asyncio.to_thread(placement.connect, engines=servers, workers=workers)
        self.placement = placement
        await asyncio.to_thread(
            self.placement.reserve,
            engines=servers,
            workers=workers,
            timeout_s=cfg.inference.launch_timeout_s,
        )
        self.on_event(f"starting {servers} engine server{'s' if servers != 1 else ''} on Ray")
        self.fleet = RayEngineFleet(
            cfg,
            placement=self.placement,
            run_dir=self.run_dir,
            servers=servers,
            policy=self.policy,
            heartbeat_timeout_s=beat,
            on_event=self._service_event,
        )
        await asyncio.to_thread(self.fleet.start)
        self.on_event("starting the gateway process")
        self.gateway = GatewayProcess(
            cfg,
            run_dir=self.run_dir,
            store_path=self.store.path,
            engine_urls=list(self.fleet.urls),
            version=self.fleet.backend.version,
            admin_token=self.admin_token,
            sock=self.address.sock,
            policy=self.policy,
            heartbeat_timeout_s=beat,
            on_event=self._service_event,
        )
        await asyncio.to_thread(self.gateway.start)
        self.url = self.gateway.url
        self.fleet.on_change = self._forward_engines
        if _loopback(self.url) and len(self.placement.machines()) > 1:
            self.on_event(
                f"warning: the gateway listens on {self.url}, which rollout workers on other "
                "machines cannot reach; set inference.host=0.0.0.0 (docs/cluster.md)"
            )
        self.on_event(f"starting {workers} rollout worker{'s' if workers != 1 else ''} on Ray")
        self.workers = RayWorkerPool(
            cfg.agent.entry or "",
            workers=workers,
            placement=self.placement,
            search_path=self.search_path,
            gateway_url=_reachable(self.url),
            framework_telemetry=cfg.agent.framework_telemetry,
            run_dir=self.run_dir,
            heartbeat_timeout_s=beat,
            policy=self.policy,
            on_event=self.on_event,
        )
        await self.workers.start()

    def nodes(self) -> dict[str, str]:
        """Service name -> the Ray node id it runs on now."""
        out: dict[str, str] = {}
        for part in (self.fleet, self.workers):
            if part is not None:
                out.update({name: node.node_id for name, node in part.nodes.items()})
        return out

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            if self.placement is not None:
                await asyncio.to_thread(self.placement.close)


def _reachable(url: str) -> str:
    """The gateway's URL as an actor on another node dials it: a wildcard bind address
    (``inference.host: 0.0.0.0``) becomes this node's IP."""
    import ray

    parsed = httpx.URL(url)
    try:
        wildcard = ipaddress.ip_address(parsed.host).is_unspecified
    except ValueError:
        return url  # a host name
    if not wildcard:
        return url
    ip = ray.util.get_node_ip_address()
    host = f"[{ip}]" if ":" in ip else ip
    return f"{parsed.scheme}://{host}:{parsed.port}"


def _loopback(url: str) -> bool:
    host = httpx.URL(url).host
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
