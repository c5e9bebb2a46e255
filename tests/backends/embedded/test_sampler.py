"""The sampler's temperature-only path (the one decode graphs capture) against the general one,
the CPU kernel that samples temperature-only rows by inverse CDF, and, on CUDA, the decode
graph that samples inside itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from areal_sdk.backends.embedded import cpu_kernels, sampler
from areal_sdk.backends.embedded.model_runner import ModelRunner, RowInput
from areal_sdk.backends.embedded.sampler import SamplingBatch, sample, sample_temperature

needs_cpu_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason="the CPU kernels could not be built here"
)


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_temperature_only_sampling_draws_what_the_general_sampler_draws(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The general torch path, as on CUDA (on CPU these rows would go to the kernel).
    monkeypatch.setattr(sampler, "_cpu_kernel_takes", lambda *_: False)
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    temps = [0.0, 1.0, 0.7, 1.3, 0.0, 1.0]
    rows = [(t, -1, 1.0, 0.0, None, 0) for t in temps]
    general = sample(logits, SamplingBatch.build(rows, logits.device, generator=_generator(5)))
    tokens, logprobs = sample_temperature(logits, torch.tensor(temps), _generator(5))
    assert tokens.tolist() == general.tokens.tolist()
    torch.testing.assert_close(logprobs, general.logprobs)
    # Greedy rows take the best token; every logprob is that of log_softmax(logits / T).
    assert tokens[0] == logits[0].argmax() and tokens[4] == logits[4].argmax()
    for row, t in enumerate(temps):
        expected = torch.log_softmax(logits[row] / (t or 1.0), dim=-1)[tokens[row]]
        torch.testing.assert_close(logprobs[row], expected)


def test_temperature_only_sampling_follows_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20_000, 4).contiguous()
    temperature = torch.full((20_000,), 0.5)
    tokens, _ = sample_temperature(logits, temperature, _generator(1))
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.5, dim=-1), atol=0.01, rtol=0)


def _temperature_rows(temps: list[float]) -> list[tuple[float, int, float, float, None, int]]:
    return [(t, -1, 1.0, 0.0, None, 0) for t in temps]


@needs_cpu_kernels
def test_cpu_kernel_follows_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).expand(20_000, 5).contiguous()
    for t in (0.5, 1.0, 2.0):
        batch = SamplingBatch.build(_temperature_rows([t] * 20_000), logits.device)
        assert sampler._cpu_kernel_takes(logits, batch)
        tokens = sample(logits, batch).tokens
        freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
        expected = torch.softmax(logits[0] / t, dim=-1)
        torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)


@needs_cpu_kernels
def test_cpu_kernel_greedy_rows_logprobs_and_reproducibility() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 49_152, generator=g) * 4
    logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a tie: the first maximum, as argmax
    temps = [0.0, 1.0, 0.7, 1.3, 0.0, 0.0, 1.0, 0.2]
    draws = [
        sample(logits, SamplingBatch.build(_temperature_rows(temps), logits.device, generator=gen))
        for gen in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))
    ]
    assert draws[0].tokens.tolist() == draws[1].tokens.tolist()  # same generator, same draws
    tokens, logprobs = draws[0].tokens, draws[0].logprobs
    for row in (0, 4, 5):
        assert tokens[row] == logits[row].argmax()
    for row, t in enumerate(temps):
        expected = torch.log_softmax(logits[row] / (t or 1.0), dim=-1)[tokens[row]]
        torch.testing.assert_close(logprobs[row], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode graphs need CUDA")
def test_decode_graph_samples_inside_the_graph(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    runner = ModelRunner(model, num_slots=4, max_len=64)
    prompt = [1, 5, 9, 13]
    runner.forward([RowInput(slot=s, start=0, tokens=prompt) for s in range(4)])
    slots, positions, tokens = [0, 1, 2, 3], [4] * 4, [7] * 4
    logits = runner.decode(slots, positions, tokens)
    drawn = runner.decode_sampled(slots, positions, tokens, [0.0] * 4)
    assert drawn is not None, "no sampling graph was captured"
    greedy, logprobs = drawn
    assert greedy == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, dim=-1).gather(1, logits.argmax(-1, keepdim=True))
    torch.testing.assert_close(torch.tensor(logprobs), expected.view(-1).cpu())
    # Each replay draws fresh noise: at a high temperature the draws differ between replays.
    draws = {tuple(runner.decode_sampled(slots, positions, tokens, [5.0] * 4)[0]) for _ in range(8)}
    assert len(draws) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode graphs need CUDA")
def test_continued_decode_steps_equal_steps_fed_from_the_host(tiny_model_dir: Path) -> None:
    """``continue_decode`` feeds a step from the previous step's tokens on the device, in the
    real CUDA graphs: greedy rows produce what steps fed from the host produce (across the
    128-position cache bucket), and a row left out stops."""
    from transformers import AutoModelForCausalLM

    from tests.backends.embedded.test_overlap_decode import assert_continued_steps_match_host_fed

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    runner = ModelRunner(model, num_slots=4, max_len=200)
    assert_continued_steps_match_host_fed(runner, steps=140, leave_at=50)
