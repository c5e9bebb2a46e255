"""Overlapped decode through the graph path, on CPU: ``continue_decode`` chains a step's inputs
from the previous step's sampled tokens inside the graphs' static buffers, and the engine reads
each step's tokens after queuing the next.

CUDA graphs need a GPU, so the runner's graphs here are a stand-in (``ReplayedOnCpu``) whose
replay runs the same eager step on the same kind of static buffers; everything else (buffer
chaining, cache-length buckets, rows leaving, the engine's bookkeeping) is the code CUDA runs.
``test_sampler.py::test_continued_decode_steps_equal_steps_fed_from_the_host`` runs the real
graphs on a GPU.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.embedded import EmbeddedEngine
from areal_sdk.backends.embedded.model_runner import ModelRunner, RowInput, _buckets
from areal_sdk.backends.embedded.sampler import sample_temperature

from areal_sdk.inference import SamplingParams
from tests.backends.embedded.conftest import make_engine
from tests.backends.embedded.test_engine import prompts


class ReplayedOnCpu:
    """A decode graph's stand-in: static inputs (ids, positions, write positions,
    temperatures) and outputs (sampled ids and logprobs); replay runs the step on them."""

    def __init__(self, runner: ModelRunner, width: int, kv_len: int) -> None:
        self.runner, self.width, self.kv_len = runner, width, kv_len
        self.inputs = torch.zeros(4, width, dtype=torch.float64)
        self.inputs[2].fill_(runner.cache.scratch)
        self.inputs[3].fill_(1.0)
        self.sampled = torch.zeros(2, width, dtype=torch.float64)
        self.graph = self
        self.replays = 0

    def replay(self) -> None:
        ids, pos, write = self.inputs[:3].long().unbind(0)
        logits = self.runner._decode_eager(ids, pos, write, kv_len=self.kv_len)
        self.logits = logits
        tokens, logprobs = sample_temperature(
            logits, self.inputs[3].float(), self.runner.graph_generator
        )
        self.sampled.copy_(torch.stack([tokens.double(), logprobs.double()]))
        self.replays += 1

    def run(self, inputs: torch.Tensor) -> torch.Tensor:
        self.inputs[:3].copy_(inputs)
        self.replay()
        return self.logits


def with_stand_in_graphs(runner: ModelRunner) -> dict[tuple[int, int], ReplayedOnCpu]:
    graphs: dict[tuple[int, int], ReplayedOnCpu] = {}
    runner._graph_buckets = _buckets(runner.num_slots)

    def graph(rows: int, kv_len: int) -> ReplayedOnCpu:
        return graphs.setdefault((rows, kv_len), ReplayedOnCpu(runner, rows, kv_len))

    runner._graph = graph  # type: ignore[method-assign]
    return graphs


def assert_continued_steps_match_host_fed(runner: ModelRunner, steps: int, leave_at: int) -> None:
    """Greedy decode of four rows, fed from the host step by step and then launched and
    continued on the device, with row 2 leaving after ``leave_at`` steps: the same tokens,
    and none for row 2 after it left."""
    starts = [[1, 5, 9, 13], [2, 4, 6], [3, 3, 3, 3, 3], [7, 8]]

    def prefill() -> list[int]:
        runner.forward([RowInput(slot=s, start=0, tokens=p[:-1]) for s, p in enumerate(starts)])
        return [len(p) - 1 for p in starts]

    positions, tokens = prefill(), [p[-1] for p in starts]
    host_steps = []
    for _ in range(steps):
        drawn = runner.decode_sampled([0, 1, 2, 3], positions, tokens, [0.0] * 4)
        assert drawn is not None
        tokens = drawn[0]
        host_steps.append(tokens)
        positions = [p + 1 for p in positions]

    launch = runner.launch_decode([0, 1, 2, 3], prefill(), [p[-1] for p in starts], [0.0] * 4)
    device_steps = []
    for step in range(steps):
        assert launch is not None and launch.graph is not None
        slots = [0, 1, 3] if step >= leave_at else [0, 1, 2, 3]
        nxt = runner.continue_decode(launch, slots) if step < steps - 1 else None
        device_steps.append(dict(zip(launch.slots, launch.result()[0], strict=True)))
        launch = nxt
    for step, (host, device) in enumerate(zip(host_steps, device_steps, strict=True)):
        assert [device[s] for s in (0, 1, 3)] == [host[s] for s in (0, 1, 3)], step
        assert (2 in device) == (step <= leave_at)
        if step <= leave_at:
            assert device[2] == host[2], step


def test_continued_steps_equal_steps_fed_from_the_host(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    runner = ModelRunner(model, num_slots=4, max_len=200)
    graphs = with_stand_in_graphs(runner)
    assert_continued_steps_match_host_fed(runner, steps=130, leave_at=40)
    assert {kv for _, kv in graphs} == {128, 201}  # crossed the 128-position cache bucket
    # The row that left writes its later steps to the scratch column, not its own cache.
    assert graphs[4, 201].inputs[2, 2] == runner.cache.scratch


async def _outputs(eng: EmbeddedEngine) -> list[list[int]]:
    items = prompts(eng, 10)
    samplings = [
        SamplingParams(max_new_tokens=3 + (7 * i) % 13, temperature=0.0, ignore_eos=True)
        for i in range(10)
    ]
    outs = await asyncio.gather(
        *(eng.generate(p, s) for p, s in zip(items, samplings, strict=True))
    )
    return [o.output_ids for o in outs]


@pytest.mark.parametrize("overlap", [True, False])
async def test_the_engine_over_graphs_generates_what_it_does_without(
    tiny_model_dir: Path, overlap: bool
) -> None:
    plain = make_engine(tiny_model_dir, overlap_decode=False)
    graphed = make_engine(tiny_model_dir, overlap_decode=overlap)
    graphs = with_stand_in_graphs(graphed.runner)
    continued = []
    runner = graphed.runner
    chain = runner.continue_decode
    runner.continue_decode = lambda *a: continued.append(1) or chain(*a)  # type: ignore[method-assign]
    try:
        assert await _outputs(graphed) == await _outputs(plain)
        assert sum(g.replays for g in graphs.values()) > 10  # decode steps ran as graphs
        assert (len(continued) > 5) == overlap  # steps queued from the previous one's tokens
    finally:
        await graphed.close()
        await plain.close()
