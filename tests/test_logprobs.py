"""token_logprobs_and_entropy equals the naive log_softmax, in values and gradients."""

from __future__ import annotations

import os

import pytest
import torch

from areal_sdk.logprobs import token_logprobs_and_entropy


def naive(hidden, weight, labels, temperature=1.0):
    logits = (hidden @ weight.T).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, labels[:, None]).squeeze(1), entropy


def _inputs(t, h, v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(t, h, generator=g) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=g)
    return hidden, weight, labels


def _grads(fn, hidden, weight, labels, **kw):
    """Values and gradients of a loss mixing logprobs and entropy with uneven weights."""
    hidden.grad = weight.grad = None
    lp, ent = fn(hidden, weight, labels, **kw)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(lp.shape, generator=g).to(lp.device)
    b = torch.randn(lp.shape, generator=g).to(lp.device)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()


# T=13 rows in chunks of 4 (last chunk partial), V=257 (prime: no block divides it).
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("t", "v", "chunk"), [(13, 257, 4), (8, 64, 8), (5, 1000, 16)])
def test_float32_values_and_gradients_equal_naive(t, v, chunk, temperature):
    hidden, weight, labels = _inputs(t, 32, v)
    want = _grads(naive, hidden, weight, labels, temperature=temperature)
    got = _grads(
        token_logprobs_and_entropy,
        hidden,
        weight,
        labels,
        temperature=temperature,
        chunk_size=chunk,
        backend="torch",
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs():
    hidden, weight, labels = _inputs(24, 64, 300, dtype=torch.bfloat16)
    lp_n, ent_n, gh_n, gw_n = _grads(naive, hidden, weight, labels, temperature=0.9)
    lp, ent, gh, gw = _grads(
        token_logprobs_and_entropy,
        hidden,
        weight,
        labels,
        temperature=0.9,
        chunk_size=5,
        backend="torch",
    )
    assert lp.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    # Same bf16 logits, float32 softmax: values agree to float32 rounding.
    torch.testing.assert_close(lp, lp_n, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ent_n, atol=1e-4, rtol=1e-4)
    # Gradients are bf16 in both; autograd sums dW over all rows at once, we per chunk.
    torch.testing.assert_close(gh.float(), gh_n.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw.float(), gw_n.float(), atol=2e-2, rtol=2e-2)


def test_without_entropy_and_with_grad_on_one_input():
    hidden, weight, labels = _inputs(6, 16, 50)
    weight = weight.detach()  # a frozen head: only hidden gets a gradient
    lp, ent = token_logprobs_and_entropy(hidden, weight, labels, chunk_size=4, with_entropy=False)
    assert ent is None
    lp.sum().backward()
    hidden_ref = hidden.detach().clone().requires_grad_()
    naive(hidden_ref, weight, labels)[0].sum().backward()
    torch.testing.assert_close(lp, naive(hidden, weight, labels)[0])
    torch.testing.assert_close(hidden.grad, hidden_ref.grad)


def test_backward_keeps_no_token_by_vocab_tensor():
    # Everything autograd saves for backward is O(T) or O(V x H), never [T, V].
    t, v = 64, 500
    hidden, weight, labels = _inputs(t, 16, v)
    saved: list[int] = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        token_logprobs_and_entropy(hidden, weight, labels, chunk_size=8)
    assert saved and max(saved) < t * v
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        naive(hidden, weight, labels)
    assert max(saved) >= t * v  # the naive path does keep one


def test_bf16_products_from_a_float32_weight_give_it_its_float32_gradient():
    # As under autocast: bf16 products, a float32 master weight. Nothing [V, H] in bf16 is
    # saved for backward, and dW comes back in float32 without a bf16 rounding.
    hidden, weight, labels = _inputs(24, 64, 300)
    saved: list[torch.Tensor] = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp, ent, gh, gw = _grads(
            token_logprobs_and_entropy,
            hidden,
            weight,
            labels,
            chunk_size=5,
            backend="torch",
            compute_dtype=torch.bfloat16,
        )
    assert not any(s.dtype == torch.bfloat16 and s.shape == weight.shape for s in saved)
    assert gw.dtype == torch.float32 and not torch.equal(gw, gw.bfloat16().float())
    bf16 = [x.detach().bfloat16().requires_grad_() for x in (hidden, weight)]
    lp_n, ent_n, gh_n, gw_n = _grads(naive, *bf16, labels)
    torch.testing.assert_close(lp, lp_n, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ent_n, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gh, gh_n.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw, gw_n.float(), atol=2e-2, rtol=2e-2)


def test_bad_inputs_are_named():
    hidden, weight, labels = _inputs(4, 8, 10)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        token_logprobs_and_entropy(hidden, weight, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="lm_head_weight"):
        token_logprobs_and_entropy(hidden, weight[:, :4], labels)
    with pytest.raises(ValueError, match="triton"):
        token_logprobs_and_entropy(hidden, weight, labels, backend="triton")


def _triton_runnable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.gpu
@pytest.mark.skipif(not _triton_runnable(), reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_bytes", [None, 0], ids=["budget_chunks", "chunk_size"])
def test_triton_kernel_equals_naive(temperature, chunk_bytes, monkeypatch):
    from areal_sdk.kernels import fused_logprobs
    from areal_sdk.kernels.fused_logprobs import fused_logprobs_and_entropy

    if chunk_bytes is not None:  # backward chunks of exactly chunk_size rows
        monkeypatch.setattr(fused_logprobs, "BACKWARD_CHUNK_BYTES", chunk_bytes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # T=70 and V=333 leave partial tiles in both directions.
    hidden, weight, labels = _inputs(70, 64, 333)
    hidden = hidden.detach().to(device).requires_grad_()
    weight = weight.detach().to(device).requires_grad_()
    labels = labels.to(device)
    want = _grads(naive, hidden, weight, labels, temperature=temperature)
    got = _grads(
        fused_logprobs_and_entropy, hidden, weight, labels, temperature=temperature, chunk_size=32
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton needs CUDA")
def test_triton_bfloat16_matches_float32_reference():
    pytest.importorskip("triton")
    hidden, weight, labels = _inputs(300, 128, 5000, dtype=torch.bfloat16)
    hidden = hidden.detach().cuda().requires_grad_()
    weight = weight.detach().cuda().requires_grad_()
    labels = labels.cuda()
    # The kernel accumulates bf16 products in float32, exactly as float32 logits from the
    # upcast inputs; only the stored bf16 gradient of the logits rounds.
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    want = _grads(naive, h32, w32, labels, temperature=0.8)
    got = _grads(
        token_logprobs_and_entropy,
        hidden,
        weight,
        labels,
        temperature=0.8,
        chunk_size=128,
        backend="triton",
    )
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    assert _rel(got[2], want[2]) < 1e-2 and _rel(got[3], want[3]) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton needs CUDA")
def test_triton_bfloat16_logprobs_alone_over_several_chunks(monkeypatch):
    """Entropy left out of the loss (its gradient never arrives), float32 dW summed in
    cuBLAS over several backward chunks."""
    pytest.importorskip("triton")
    from areal_sdk.kernels import fused_logprobs

    monkeypatch.setattr(fused_logprobs, "BACKWARD_CHUNK_BYTES", 0)
    hidden, weight, labels = _inputs(300, 128, 5000, dtype=torch.bfloat16, seed=3)
    hidden = hidden.detach().cuda().requires_grad_()
    weight = weight.detach().cuda().requires_grad_()
    labels = labels.cuda()
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    naive(h32, w32, labels)[0].sum().backward()
    lp, _ = token_logprobs_and_entropy(hidden, weight, labels, chunk_size=64, backend="triton")
    lp.sum().backward()
    assert _rel(hidden.grad, h32.grad) < 1e-2 and _rel(weight.grad, w32.grad) < 1e-2


# -- backend="stored": the softmax kept for backward -------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy_grad", [True, False], ids=["entropy_grad", "logprobs_only"])
def test_stored_softmax_values_and_gradients_equal_naive(
    temperature, with_entropy_grad, monkeypatch
):
    from areal_sdk.kernels import stored_softmax

    monkeypatch.setattr(stored_softmax, "CHUNK_ROWS", 4)  # 13 rows: a partial last chunk
    hidden, weight, labels = _inputs(13, 32, 257)

    def loss(fn, **kw):
        hidden.grad = weight.grad = None
        lp, ent = fn(hidden, weight, labels, temperature=temperature, **kw)
        g = torch.Generator().manual_seed(1)
        a, b = torch.randn(13, generator=g), torch.randn(13, generator=g)
        ((lp * a).sum() + ((ent * b).sum() if with_entropy_grad else 0.0)).backward()
        return lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()

    want = loss(naive)
    got = loss(token_logprobs_and_entropy, backend="stored")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_stored_softmax_bf16_products_from_a_float32_weight():
    hidden, weight, labels = _inputs(24, 64, 300)
    want = _grads(
        token_logprobs_and_entropy,
        hidden,
        weight,
        labels,
        chunk_size=5,
        backend="torch",
        compute_dtype=torch.bfloat16,
    )
    got = _grads(
        token_logprobs_and_entropy,
        hidden,
        weight,
        labels,
        backend="stored",
        compute_dtype=torch.bfloat16,
    )
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
    # Same bf16 logits: values to float32 rounding; gradients through bf16 probabilities.
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    for g, w in zip(got[2:], want[2:], strict=True):
        assert float((g - w).norm() / w.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled softmax pass runs on CUDA")
@pytest.mark.parametrize("with_entropy_grad", [True, False], ids=["entropy_grad", "logprobs_only"])
def test_stored_softmax_on_cuda_matches_float32_reference(with_entropy_grad, monkeypatch):
    """The CUDA path: cuBLAS logits into the kept buffer, the compiled in-place softmax,
    float32 products over bf16 probabilities in backward."""
    from areal_sdk.kernels import stored_softmax

    monkeypatch.setattr(stored_softmax, "CHUNK_ROWS", 128)  # 300 rows: three chunks
    hidden, weight, labels = _inputs(300, 128, 5000, dtype=torch.bfloat16)
    hidden = hidden.detach().cuda().requires_grad_()
    weight = weight.detach().cuda().requires_grad_()
    labels = labels.cuda()
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()

    def loss(fn, h, w, **kw):
        h.grad = w.grad = None
        lp, ent = fn(h, w, labels, temperature=0.8, **kw)
        a = torch.linspace(-1, 1, 300, device="cuda")
        ((lp * a).sum() + ((ent * a.flip(0)).sum() if with_entropy_grad else 0.0)).backward()
        return lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()

    want = loss(naive, h32, w32)
    got = loss(token_logprobs_and_entropy, hidden, weight, backend="stored")
    # float32 logits from the bf16 operands: values to float32 rounding; the gradients go
    # through the kept bf16 probabilities.
    torch.testing.assert_close(got[0], want[0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-3)
    assert _rel(got[2], want[2]) < 2e-2 and _rel(got[3], want[3]) < 2e-2
