"""The one-pass Triton sampler (CUDA only; the engine's decode graphs use it there) against the
torch sampler's contract: greedy rows take the first maximum, every logprob is that of
``log_softmax(logits / T)``, draws follow the tempered distribution, and a CUDA graph that
registered the generator draws fresh tokens on each replay."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs CUDA and triton",
)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [50, 151_936])
def test_logprobs_and_greedy_rows_match_torch(dtype: torch.dtype, vocab: int) -> None:
    from areal_sdk.kernels.fused_sampling import sample_temperature

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(9, vocab, device="cuda", generator=g) * 4).to(dtype)
    logits[5, 7] = logits[5, vocab - 1] = logits[5].max() + 1  # a tie: the first maximum wins
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 0.0, 1.0, 0.2, 2.0], device="cuda")
    tokens, logprobs = sample_temperature(logits, temps, _generator(1))
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32
    greedy = (temps <= 0).nonzero().view(-1)
    assert tokens[greedy].tolist() == logits.float()[greedy].argmax(dim=-1).tolist()
    assert tokens[5] == 7
    scale = torch.where(temps > 0, temps, torch.ones_like(temps)).view(-1, 1)
    expected = torch.log_softmax(logits.float() / scale, dim=-1).gather(1, tokens.view(-1, 1))
    torch.testing.assert_close(logprobs, expected.view(-1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [5, 6_000])
def test_draws_follow_the_tempered_distribution(vocab: int) -> None:
    from areal_sdk.kernels.fused_sampling import sample_temperature

    # The mass sits on columns that fall in different vocabulary splits when vocab is large.
    row = torch.full((vocab,), -30.0, device="cuda")
    hot = torch.tensor([0, 1, vocab // 2, vocab - 1], device="cuda")
    row[hot] = torch.tensor([2.0, 1.0, 0.0, -1.0], device="cuda")
    logits = row.expand(20_000, vocab).contiguous()
    for t in (0.5, 1.0, 2.0):
        tokens, _ = sample_temperature(logits, torch.full((20_000,), t, device="cuda"))
        freq = torch.bincount(tokens, minlength=vocab).float() / tokens.numel()
        expected = torch.softmax(row / t, dim=-1)
        torch.testing.assert_close(freq[hot], expected[hot], atol=0.012, rtol=0)
        assert freq.sum().item() == pytest.approx(1.0)


def test_same_generator_same_draws_and_fresh_draws_on_each_graph_replay() -> None:
    from areal_sdk.kernels.fused_sampling import sample_temperature

    logits = torch.zeros(64, 1000, device="cuda")  # uniform: every draw is pure noise
    temps = torch.ones(64, device="cuda")
    a, _ = sample_temperature(logits, temps, _generator(3))
    b, _ = sample_temperature(logits, temps, _generator(3))
    assert a.tolist() == b.tolist()

    gen = _generator(4)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample_temperature(logits, temps, gen)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        tokens, logprobs = sample_temperature(logits, temps, gen)
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(tokens.tolist())
    assert draws[0] != draws[1] != draws[2]
    torch.testing.assert_close(
        logprobs, torch.full_like(logprobs, -torch.log(torch.tensor(1000.0)).item())
    )
