"""One GRPO training step of the torch backend under three attention layouts of a micro-batch:
one packed row with a block-diagonal mask (``packed``), the sequences as a right-padded batch
(``train.padded_attention``), and per-sequence attention from the packing boundaries
(``train.attn_implementation: varlen``). Same model, samples and micro-batches; best of
``--repeats``.

    python benchmarks/attention_layout.py --model smollm2-135m-instruct --seqs 16 --lengths 80,110
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    from areal_sdk.algorithms.advantages import sample_advantages
    from areal_sdk.algorithms.losses import make_loss_fn
    from areal_sdk.config import load_config
    from areal_sdk.packing import pack_samples
    from areal_sdk.plugin_host import get_host
    from areal_sdk.samples import TrainingSample

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--lengths", default="80,110", help="min,max tokens per sequence")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layouts", default="packed,padded,varlen")
    args = parser.parse_args()
    source = "path" if Path(args.model).exists() else "name"
    base = [
        f"model.{source}={args.model}",
        f"train.device={args.device}",
        "train.bf16=true",
        f"train.micro_batch_tokens={args.micro_batch_tokens}",
    ]
    cfg = load_config(None, base)
    lo, hi = (int(x) for x in args.lengths.split(","))
    rng = random.Random(0)
    samples = []
    for i in range(args.seqs):
        n = rng.randint(lo, hi)
        samples.append(
            TrainingSample(
                episode_id=f"e{i}",
                group_id=f"g{i // 8}",
                task_id=f"t{i // 8}",
                turn_ids=[f"u{i}"],
                input_ids=[rng.randrange(1000) for _ in range(n)],
                loss_mask=[0] * (n - 10) + [1] * 10,
                logprobs=[-1.0] * n,
                versions=[0] * n,
                reward=float(i % 2),
            )
        )
    adv = sample_advantages(samples, "grpo")
    loss_fn = make_loss_fn(cfg.algorithm, current_version=0)
    layouts = {
        "packed": [],
        "padded": ["train.padded_attention=true"],
        "varlen": ["train.attn_implementation=varlen"],
    }
    results: dict[str, float] = {}
    for layout in args.layouts.split(","):
        layout_cfg = load_config(None, [*base, *layouts[layout]])
        backend = get_host().train_backend("torch")(layout_cfg)
        best = float("inf")
        for _ in range(args.repeats):
            (mbs,) = pack_samples(samples, adv, args.micro_batch_tokens)
            start = time.perf_counter()
            backend.train_step(mbs, loss_fn)
            best = min(best, time.perf_counter() - start)
        results[layout] = best
        backend.close()
    print(json.dumps({"args": vars(args), "step_s": results, "micro_batches": len(mbs)}))


if __name__ == "__main__":
    main()
