"""``cuda_ipc`` into SGLang servers: trainer and server on one GPU, in two processes.

``make_weight_sync("cuda_ipc", config, engine=<SGLangBackend>)`` returns this. Per bucket
of ``TrainBackend.state_for_sync`` the trainer casts the tensors to ``weights.dtype`` into
one contiguous buffer on its own GPU and sends every live server
``/update_weights_from_tensor`` with ``load_format: "flattened_bucket"``: the payload is a
CUDA IPC handle to that buffer plus each tensor's name, shape and element range, never the
bytes. The server copies the tensors into its parameters before it answers, so the buffer
is kept alive until then and freed after. A bucket that mixes dtypes (``weights.dtype:
auto``) goes as one request per dtype. The last request carries ``weight_version``; then
every server must report that version (``/get_weight_version``).

The same protocol runs on CPU tensors, which travel as shared-memory file descriptors; that
works only when the server is in the trainer's process (the tests), since passing a
descriptor needs the sender's ``multiprocessing`` authkey.

A server that refuses a bucket, or a push not done within ``timeout_s``, fails with
``WeightSyncError`` naming the servers and the version; the servers keep serving the
buckets they loaded, under the old version number.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from areal_sdk.backends.embedded.weight_stage import INCOMPLETE_STAGE
from areal_sdk.backends.sglang.weight_sync import ServerWeightSync
from areal_sdk.backends.weight_sync.base import NamedTensors, PeerLostError
from areal_sdk.backends.weight_sync.cuda_ipc import flattened_bucket, sglang_payload

if TYPE_CHECKING:
    from areal_sdk.backends.sglang.backend import SGLangBackend

    from areal_sdk.config import Config


def split_by_dtype(
    bucket: NamedTensors, dtype: torch.dtype | None
) -> list[tuple[torch.dtype, NamedTensors]]:
    """The bucket's tensors grouped by the dtype they are sent in (``dtype`` for floating
    point ones, their own otherwise), in first-seen order."""
    groups: dict[torch.dtype, NamedTensors] = {}
    for name, t in bucket:
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        groups.setdefault(target, []).append((name, t))
    return list(groups.items())


class SGLangTensorSync(ServerWeightSync):
    """Trainer side of SGLang's ``/update_weights_from_tensor`` (colocated servers)."""

    method = "cuda_ipc"

    def __init__(
        self,
        engine: SGLangBackend,
        *,
        device: torch.device | str = "cuda",
        timeout_s: float = 120.0,
        dtype: torch.dtype | None = None,
        trainer_rank: int = 0,
        flush_cache: bool = True,
        staged: bool = False,
    ) -> None:
        super().__init__(timeout_s=timeout_s, dtype=dtype, trainer_rank=trainer_rank)
        self.engine = engine
        self.device = torch.device(device)
        self.flush_cache = flush_cache
        # The servers stage buckets and load them at once (our engine's servers): the push
        # needs no pause, so generation goes on while the buckets travel.
        self.swaps_atomically = staged

    @classmethod
    def from_config(
        cls, engine: SGLangBackend, config: Config, *, trainer_rank: int = 0, **overrides: Any
    ) -> SGLangTensorSync:
        args = {
            **cls.config_args(config, trainer_rank),
            # Without a pause, a retract's recomputation happens at the swap.
            "flush_cache": config.inference.recompute_kv_on_update
            or config.weights.pause_mode == "retract",
            "staged": config.inference.backend == "embedded",
        }
        return cls(engine, **{**args, **overrides})

    async def _push(self, state: Iterable[NamedTensors], version: int) -> tuple[int, int]:
        deadline = time.monotonic() + self.timeout_s
        buckets = iter(state)
        tensors = nbytes = index = 0

        async def next_bucket() -> NamedTensors | None:
            # Gathering a bucket may block (ZeRO-3): keep it off the event loop.
            while True:
                bucket = await asyncio.to_thread(next, buckets, None)
                if bucket is None or bucket:
                    return bucket

        try:
            bucket = await next_bucket()
            while bucket is not None:
                # One bucket ahead, so the last request is known and can carry the version.
                following = await next_bucket()
                groups = split_by_dtype(bucket, self.dtype)
                for i, (dtype, part) in enumerate(groups):
                    last = following is None and i == len(groups) - 1
                    nbytes += await self._send(part, dtype, version, last, index, deadline)
                    tensors += len(part)
                    index += 1
                bucket = following
            if index == 0:  # nothing to send: only the version moves
                await self.engine.set_version(version)
            served = await asyncio.wait_for(self.engine.served_versions(), self._left(deadline))
        except Exception as exc:
            what = str(exc) or f"no answer within timeout_s={self.timeout_s:g} s"
            failure = self._fail(version, self._peers, f"bucket request {index}: {what}")
            if INCOMPLETE_STAGE in what:
                # A server joined (or restarted) mid-push and missed staged buckets: a fresh
                # push reaches every server in rotation now.
                raise PeerLostError(str(failure), lost=[]) from exc
            raise failure from exc
        finally:
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()  # free buckets the servers have released
        stale = {url: v for url, v in served.items() if v != version}
        if stale:
            raise self._fail(version, self._peers, f"servers report other versions: {stale}")
        return tensors, nbytes

    async def _send(
        self,
        part: NamedTensors,
        dtype: torch.dtype,
        version: int,
        last: bool,
        index: int,
        deadline: float,
    ) -> int:
        """Request ``index`` of the push: loaded at once, staged (``swaps_atomically``), or
        with ``last`` the one that makes the servers serve ``version``."""
        bucket = flattened_bucket(part, self.device, dtype)
        flat = bucket["flattened_tensor"]
        size = flat.numel() * flat.element_size()
        if flat.is_cuda:
            # The server reads this memory from another process: no stream order there.
            torch.cuda.current_stream(flat.device).synchronize()
        left = self._left(deadline)
        staging = self.swaps_atomically and not last
        await asyncio.wait_for(
            self.engine.update_weights_from_tensor(
                sglang_payload(bucket),
                weight_version=version if last else None,
                timeout_s=left,
                flush_cache=self.flush_cache,
                stage_for_version=version if staging else None,
                staged_buckets=index if self.swaps_atomically and last else 0,
            ),
            left,
        )
        # Every server has copied the bucket: only now may its memory go.
        del bucket, flat
        return size

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the push took longer than timeout_s={self.timeout_s:g} s")
        return left
