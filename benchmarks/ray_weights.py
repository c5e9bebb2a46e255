"""Weight pushes to Ray-placed engine servers: ``disk`` against ``broadcast``.

Starts a local Ray cluster of one head and ``--servers`` engine nodes (``ray.cluster_utils``,
all on this machine), places one ``areal-sdk engine`` server on each engine node exactly as
``run.placement=ray`` does (``RayEngineFleet``, ``ray.strategy=SPREAD``), and times
``WeightSync.push`` of the model's weights from this process, as the run's process pushes
rank 0's buckets, with each method in turn (alternating, ``--pushes`` each). A push returns
once every server serves the new version.

- ``disk``: safetensors of the version under the run directory, then every server's
  ``/update_weights_from_disk``;
- ``broadcast``: every server joins a gloo group with this process as rank 0
  (``/init_weights_update_group``; the first push pays for it, reported apart), then per
  bucket ``/update_weights_from_distributed`` while this process broadcasts the tensors.

``--object-store`` adds what Ray's object store would cost at best: ``ray.put`` of the
buckets here and ``ray.get`` of all of them by an actor on each engine node (the bytes
reach the node; loading them into the engine is not counted, and no engine method exists).

    python benchmarks/ray_weights.py --model tiny --pushes 5
    python benchmarks/ray_weights.py --model qwen2-0.5b --dtype bfloat16 --pushes 3 --object-store
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.shapes import QWEN2_05B  # noqa: E402

METHODS = ("disk", "broadcast")


def build_model(out: Path, name: str) -> Path:
    from tests.tiny_model import build_tiny_model, build_tokenizer

    if name == "tiny":
        return build_tiny_model(out)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    build_tokenizer(out)  # the engine loads one; only the weights are timed
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN2_05B)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def load_state(model_dir: Path, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The weights under the names a trainer sends (tied ones once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def buckets(state: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Any]:
    from areal_sdk.backends.train.policy import plan_buckets

    sizes = [t.numel() * t.element_size() for _, t in state]
    return [[state[i] for i in plan] for plan in plan_buckets(sizes, bucket_bytes)]


def config(args: argparse.Namespace, model_dir: Path, run_dir: Path, address: str) -> Any:
    from areal_sdk.config import load_config

    return load_config(
        None,
        [
            f"model.path={model_dir}",
            f"model.dtype={args.dtype}",
            "inference.device=cpu",
            f"inference.servers={args.servers}",
            "inference.max_model_len=256",
            "inference.max_batch_size=4",
            f"inference.launch_timeout_s={args.launch_timeout}",
            "train.device=cpu",
            f"run.dir={run_dir}",
            f"ray.address={address}",
            "ray.strategy=SPREAD",
            "ray.engine.num_cpus=1",
            "ray.engine.resources={engine_slot: 1}",
            f"weights.bucket_mb={args.bucket_mb}",
            "weights.timeout_s=600",
        ],
    )


def object_store_push(bucket_list: list[Any], fetchers: list[Any]) -> float:
    import ray

    start = time.perf_counter()
    refs = [ray.put(b) for b in bucket_list]
    ray.get([f.fetch.remote(refs) for f in fetchers], timeout=600)
    return time.perf_counter() - start


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ray
    from areal_sdk.backends.weight_sync import make_weight_sync
    from ray.cluster_utils import Cluster

    from areal_sdk.services.placement import for_placement
    from areal_sdk.services.ray_engines import RayEngineFleet
    from areal_sdk.services.ray_placement import RayPlacement

    @ray.remote(num_cpus=0.5)
    class Fetcher:
        def fetch(self, refs: list[Any]) -> int:
            return sum(t.numel() for bucket in ray.get(refs) for _, t in bucket)

    tmp = Path(tempfile.mkdtemp(prefix="ray-weights-"))
    model_dir = build_model(tmp / "model", args.model)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    state = load_state(model_dir, dtype)
    bucket_list = buckets(state, args.bucket_mb << 20)
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    params = sum(t.numel() for _, t in state)
    # Room for a version in each node's object store (the test cluster's default is 150 MB).
    store = max(512 << 20, 2 * nbytes)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": store},
    )
    fleet = placement = None
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(args.servers):
            cluster.add_node(num_cpus=2, resources={"engine_slot": 2}, object_store_memory=store)
        cluster.wait_for_nodes()
        cfg = config(args, model_dir, tmp / "run", cluster.address)
        placement = RayPlacement(cfg).connect(engines=args.servers, workers=0)
        placement.reserve(engines=args.servers, workers=0, timeout_s=args.launch_timeout)
        fleet = RayEngineFleet(cfg, placement=placement, run_dir=tmp / "run")
        await asyncio.to_thread(fleet.start)
        engine = fleet.backend
        syncs = {}
        for method in METHODS:
            # As the run resolves it: broadcast's rank 0 at this node's IP.
            chosen = cfg.model_copy(
                update={"weights": cfg.weights.model_copy(update={"method": method})}
            )
            syncs[method] = make_weight_sync(method, for_placement(chosen, "ray"), engine=engine)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        version = 0
        for _ in range(args.pushes + 1):  # the first round warms up (and opens the group)
            for method, sync in syncs.items():
                version += 1
                start = time.perf_counter()
                await sync.push(iter(bucket_list), version)
                times[method].append(time.perf_counter() - start)
                served = await engine.served_versions()
                assert set(served.values()) == {version}, served
        for method in METHODS:
            steady = times[method][1:]
            rows.append(
                {
                    "method": method,
                    "first_s": times[method][0],
                    "median_s": statistics.median(steady),
                    "min_s": min(steady),
                    "max_s": max(steady),
                }
            )
        if args.object_store:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            fetchers = [  # one on each engine server's node
                Fetcher.options(  # type: ignore[attr-defined]
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
                ).remote()
                for node in fleet.nodes.values()
            ]
            ray.get([f.fetch.remote([]) for f in fetchers], timeout=120)
            moved = [object_store_push(bucket_list, fetchers) for _ in range(args.pushes + 1)]
            rows.append(
                {
                    "method": "object store (transfer only)",
                    "first_s": moved[0],
                    "median_s": statistics.median(moved[1:]),
                    "min_s": min(moved[1:]),
                    "max_s": max(moved[1:]),
                }
            )
        for sync in syncs.values():
            await sync.close()
    finally:
        if fleet is not None:
            await fleet.backend.close()
            fleet.stop()
        if placement is not None:
            placement.close()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"model {args.model}: {params:,} parameters, {nbytes / 2**20:.1f} MiB as {args.dtype}, "
        f"{len(bucket_list)} bucket(s) of <= {args.bucket_mb} MiB; {args.servers} engine "
        f"servers on {args.servers} Ray nodes; {args.pushes} timed pushes per method"
    )
    print()
    print("| method | first push | median | min | max | MiB/s (median) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        rate = nbytes / 2**20 / row["median_s"]
        print(
            f"| {row['method']} | {row['first_s']:.3f} s | {row['median_s']:.3f} s | "
            f"{row['min_s']:.3f} s | {row['max_s']:.3f} s | {rate:.0f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "qwen2-0.5b"), default="tiny")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--servers", type=int, default=2, help="engine servers, one per node")
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes per method")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--launch-timeout", type=float, default=600.0)
    parser.add_argument("--object-store", action="store_true", help="also ray.put / ray.get")
    args = parser.parse_args()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
