"""One rank of a DeepSpeed test job (run in a fresh process: DeepSpeed owns the process group)."""

from __future__ import annotations

import os
import traceback
from typing import Any

from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single, train_config


def run_rank(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    stage: int,
    ckpt: str,
    out: Any,
    lora: dict[str, Any] | None = None,
) -> None:
    """Train 2 steps, save, train 2 more; then resume from the save and train the same 2."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        from areal_sdk.backends.train.deepspeed_backend import DeepSpeedBackend

        cfg = train_config(
            backend="deepspeed",
            zero_stage=stage,
            # Partition even the tiny model's small weights, so ZeRO-3 really gathers.
            deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
            lora=lora,
        )
        batches = micro_batches(40, num_ranks=world)[rank]
        backend = DeepSpeedBackend(model_dir, cfg)
        losses = [backend.train_step(batches, loss_fn(k))["loss"] for k in range(2)]
        backend.save(ckpt)
        checkpoint_state = {}
        if rank == 0:
            from areal_sdk.checkpoints import read_weights

            checkpoint_state = {n: tuple(t.shape) for n, t in read_weights(ckpt).items()}
        losses += [backend.train_step(batches, loss_fn(k))["loss"] for k in range(2, 4)]
        state = {n: tuple(t.shape) for b in backend.state_for_sync(64 * 1024) for n, t in b}
        probe = backend.forward_logprobs([single(FIXED_SEQUENCE)])[0]
        step = backend.step
        backend.close()

        resumed = DeepSpeedBackend(model_dir, cfg)
        resumed.load(ckpt)
        resumed_step = resumed.step
        resumed_losses = [resumed.train_step(batches, loss_fn(k))["loss"] for k in range(2, 4)]
        if rank == 0:
            out.put(
                {
                    "losses": losses,
                    "resumed_losses": resumed_losses,
                    "resumed_step": resumed_step,
                    "step": step,
                    "state": state,
                    "checkpoint_state": checkpoint_state,
                    "probe": probe.tolist(),
                    "zero_stage": backend.zero_stage,
                }
            )
        resumed.close()
        # Leave the group together: a rank exiting while its peer still holds the gloo
        # connection can abort the peer at interpreter exit.
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        out.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise
