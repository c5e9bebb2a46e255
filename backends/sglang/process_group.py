"""The weight-update process group, built the way SGLang's ``/init_weights_update_group``
builds it, so a trainer and an SGLang server (or the embedded engine) meet in one group.

SGLang (``srt/utils`` ``init_custom_process_group``) rendezvouses at
``tcp://master_address:master_port`` (the trainer, rank 0, hosts the store), wraps the store
in ``PrefixStore(group_name)`` and creates the group with torch's
``_new_process_group_helper``, apart from any default group. Both sides must do the same
for their keys to line up; they also need compatible torch/NCCL builds for NCCL.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def init_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 120.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group ``group_name``; blocks until every rank has joined
    (gloo) or, for NCCL, until the first collective."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_from_trainer(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """``dist.broadcast(tensor, src=0, group=group)``: what SGLang's receiver waits for."""
    dist.broadcast(tensor, src=0, group=group)


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
