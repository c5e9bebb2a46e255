"""One GRPO step of the torch train backend with each group's prompt packed once
(``train.share_prefixes``) against every member packed whole, interleaved on one backend.

    python benchmarks/shared_prefix.py --model ~/.cache/areal-sdk/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from areal_sdk.algorithms.losses import make_loss_fn
from areal_sdk.config import AlgorithmConfig, TrainConfig
from areal_sdk.packing import pack_samples
from areal_sdk.samples import TrainingSample


def groups(args: argparse.Namespace, vocab: int) -> tuple[list[TrainingSample], list[float]]:
    """``args.groups`` groups of ``args.group_size`` answers of ``args.answer_len`` tokens
    (+ the member's index) after one random prompt of ``args.prompt_len`` tokens each."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(args.groups):
        prompt = torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist()
        for i in range(args.group_size):
            answer = torch.randint(1, vocab, (args.answer_len + i,), generator=g).tolist()
            mask = [0] * len(prompt) + [1] * len(answer)
            samples.append(
                TrainingSample(
                    episode_id=f"e{k}-{i}",
                    group_id=f"g{k}",
                    task_id=f"t{k}",
                    turn_ids=["u"],
                    input_ids=prompt + answer,
                    loss_mask=mask,
                    logprobs=[-1.0 if m else 0.0 for m in mask],
                    versions=[0 if m else -1 for m in mask],
                    reward=float(i % 2),
                )
            )
    return samples, [1.0 if i % 2 else -1.0 for i in range(len(samples))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a local HF model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=89)
    parser.add_argument("--answer-len", type=int, default=10)
    parser.add_argument("--micro-batch-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from areal_sdk.backends.train.torch_backend import TorchBackend

    on_cpu = args.device == "cpu"
    cfg = TrainConfig(
        device=args.device,
        bf16=True,
        micro_batch_tokens=args.micro_batch_tokens,
        logprob_chunk_size=256 if on_cpu else 1024,
        optimizer_state_dtype="bfloat16" if on_cpu else "auto",
    )
    backend = TorchBackend(args.model, cfg)
    vocab = int(backend.model.policy.config.vocab_size)
    samples, advantages = groups(args, vocab)
    loss_fn = make_loss_fn(AlgorithmConfig(), 0)
    # A first step of each kind outside the timings (kernels, allocator, compile).
    for share in (False, True):
        (batches,) = pack_samples(
            samples, advantages, args.micro_batch_tokens, share_prefixes=share
        )
        backend.train_step(batches, loss_fn)
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, int] = {}
    for _ in range(args.rounds):
        for share in (False, True):
            (batches,) = pack_samples(
                samples, advantages, args.micro_batch_tokens, share_prefixes=share
            )
            tokens[share] = sum(b.num_tokens for b in batches)
            if not on_cpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            backend.train_step(batches, loss_fn)
            if not on_cpu:
                torch.cuda.synchronize()
            times[share].append(time.perf_counter() - start)
    for share in (False, True):
        print(
            json.dumps(
                {
                    "share_prefixes": share,
                    "tokens": tokens[share],
                    "step_s": [round(t, 3) for t in times[share]],
                    "median_s": round(sorted(times[share])[len(times[share]) // 2], 3),
                }
            )
        )


if __name__ == "__main__":
    main()
