"""A lean forward for Llama-family decoders (Llama, Qwen2, Mistral): the engine's default
(``EngineConfig.fused_decoder``). On CUDA its norm, rotary and SiLU parts are compiled into
one kernel each: a 0.5B decode step is 833 kernels instead of 2,239, and the engine gives
1.34x the output tokens/s at 256 rows on an H100 (benchmarks/engine.md).

On CPU a decode step is small (16 rows x 576 features for SmolLM2), so its cost is the
number of operations and of Python calls, not their arithmetic. The transformers modules
spend ~45 tensor operations per layer and several wrapper calls each (RMSNorm as seven ops,
three projections where one would do). This forward runs the same mathematics in ~20
operations per layer from the same parameters:

- query, key and value come from one product with the three weights stacked, gate and up
  from another (``packed_linear.StackedLinear``, rebuilt when a weight update writes a
  member);
- the residual add and the RMSNorm after it are one kernel, SiLU and the product after it
  another, rotary embedding and the KV-cache write a third (``cpu_kernels``; torch ops
  where they cannot be built), with the cos/sin of the model's own rotary module;
- attention reads the engine's slot KV cache, as on the HF path.

It only takes models whose layers have exactly that structure (``supports``); any other
model runs its transformers modules. Outputs equal the HF forward's to float rounding
(``tests/backends/embedded/test_fused_decoder.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from areal_sdk.backends.embedded import cpu_kernels
from areal_sdk.backends.embedded.kv_cache import StepContext, attend_cached, slot_attention
from areal_sdk.backends.embedded.packed_linear import CopiesByName, StackedLinear

MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


def supports(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a Llama-family decoder this forward reproduces exactly."""
    config = model.config
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", None) != "silu" or getattr(
        config, "use_sliding_window", False
    ):
        return False
    if getattr(config, "sliding_window", None) and config.model_type == "mistral":
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return False
    backbone = model.get_decoder()
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(backbone, name) for name in needed):
        return False
    return all(_layer_fits(layer) for layer in backbone.layers)


def _layer_fits(layer: torch.nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    parts += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    # Extra submodules (Qwen3's q_norm/k_norm, ...) mean mathematics this forward lacks.
    known = {"q_proj", "k_proj", "v_proj", "o_proj"}
    return (
        all(isinstance(p, torch.nn.Linear) for p in parts)
        and all(n is not None and hasattr(n, "weight") for n in norms)
        and set(dict(attn.named_children())) <= known
    )


@dataclass
class _Layer:
    attn: torch.nn.Module
    qkv: StackedLinear
    gate_up: StackedLinear
    o_proj: torch.nn.Linear
    down_proj: torch.nn.Linear
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    eps_in: float
    eps_post: float


class FusedDecoder:
    """The fused forward of one model's decoder (see the module docstring).

    >>> decoder = FusedDecoder(model, packed=True)
    >>> hidden = decoder.hidden(ids, positions, step)  # what the backbone returns
    """

    def __init__(self, model: torch.nn.Module, *, packed: bool) -> None:
        backbone = model.get_decoder()
        cfg = model.config
        self.embed = backbone.embed_tokens
        self.rotary = backbone.rotary_emb
        self.final_norm = backbone.norm.weight
        self.final_eps = _eps(backbone.norm)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.layers = [self._layer(layer, packed) for layer in backbone.layers]
        weight = backbone.norm.weight
        kernel = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
        kernel = kernel and cpu_kernels.available()
        self._add_rms_norm = cpu_kernels.add_rms_norm if kernel else _add_rms_norm
        self._silu_mul = cpu_kernels.silu_mul if kernel else _silu_mul
        self._rope = _rope
        self._rope_write = kernel
        if weight.device.type == "cuda":
            # On a GPU each of these is one generated kernel instead of 3-9 (a decode step is
            # ~10 kernels a layer instead of ~40; at a few microseconds each, the count is the
            # cost). Dynamic shapes: one compile serves every batch and prefill size.
            self._add_rms_norm, self._silu_mul, self._rope = _compiled_parts()
        self.stacks = [f for layer in self.layers for f in (layer.qkv, layer.gate_up)]
        self._by_name = CopiesByName(
            model,
            lambda p: [
                f for f in self.stacks if any(q is p for m in f.linears for q in m.parameters())
            ],
        )

    @staticmethod
    def _layer(layer: torch.nn.Module, packed: bool) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(
            attn=attn,
            qkv=StackedLinear([attn.q_proj, attn.k_proj, attn.v_proj], packed=packed),
            gate_up=StackedLinear([mlp.gate_proj, mlp.up_proj], packed=packed),
            o_proj=attn.o_proj,
            down_proj=mlp.down_proj,
            norm_in=layer.input_layernorm.weight,
            norm_post=layer.post_attention_layernorm.weight,
            eps_in=_eps(layer.input_layernorm),
            eps_post=_eps(layer.post_attention_layernorm),
        )

    @property
    def fused_linears(self) -> list[torch.nn.Linear]:
        """The linear layers whose products run fused here (no packed copy needed)."""
        return [m for f in self.stacks for m in f.linears]

    def weights_changed(self, names: Iterable[str]) -> None:
        """Rebuild the fused products that parameters ``names`` belong to."""
        for fused in self._by_name.stale(names):
            fused.rebuild()

    def _attend(
        self,
        attn: torch.nn.Module,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepContext,
    ) -> torch.Tensor:
        """Rotary embedding, the cache write and attention for one layer's ``qkv``; returns
        ``[rows, tokens, heads, head_dim]``."""
        index = attn.layer_idx
        if self._rope_write:  # rotary and the cache write in one kernel
            query = cpu_kernels.rope_write(
                qkv,
                cos,
                sin,
                step.cache.keys[index],
                step.cache.values[index],
                step.slot_index,
                step.write_pos,
                self.heads,
            )
            return attend_cached(step, index, query.transpose(1, 2), attn.scaling)[0]
        rows, tokens, _ = qkv.shape
        dim, qk_heads = self.head_dim, self.heads + self.kv_heads
        qk = qkv[..., : qk_heads * dim].view(rows, tokens, qk_heads, dim)
        # cos/sin [rows, tokens, 1, dim] broadcast over the query and key heads together.
        qk = self._rope(qk, cos, sin)
        query = qk[:, :, : self.heads].transpose(1, 2)
        key = qk[:, :, self.heads :].transpose(1, 2)
        value = qkv[..., qk_heads * dim :].view(rows, tokens, self.kv_heads, dim).transpose(1, 2)
        out, _ = slot_attention(
            attn, query, key, value, None, scaling=attn.scaling, areal_step=step
        )
        return out

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, step: StepContext) -> torch.Tensor:
        """``[rows, tokens, hidden]`` final hidden states for ``ids`` at positions ``pos``."""
        hidden = self.embed(ids)
        cos, sin = self.rotary(hidden, position_ids=pos)  # [rows, tokens, head_dim]
        rows, tokens = ids.shape
        q_width = self.heads * self.head_dim
        add_norm = self._add_rms_norm
        delta = None  # the last sublayer's output, added to the residual by the next norm
        for layer in self.layers:
            x = add_norm(hidden, delta, layer.norm_in, layer.eps_in)
            qkv = layer.qkv(x)
            out = self._attend(layer.attn, qkv, cos, sin, step)
            attended = layer.o_proj(out.reshape(rows, tokens, q_width))
            x = add_norm(hidden, attended, layer.norm_post, layer.eps_post)
            delta = layer.down_proj(self._silu_mul(layer.gate_up(x)))
        return add_norm(hidden, delta, self.final_norm, self.final_eps)


def _eps(norm: torch.nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps if eps is not None else getattr(norm, "eps", 1e-6))


def _add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``cpu_kernels.add_rms_norm`` in torch: ``hidden += delta``, then transformers'
    ``LlamaRMSNorm`` of it (float32 statistics, rounded before the weight)."""
    if delta is not None:
        hidden.add_(delta)
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``cpu_kernels.silu_mul`` in torch."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``[rows, tokens, heads, dim]`` with ``[rows, tokens, dim]``
    cos/sin, broadcast over the heads (the queries' and keys' together)."""
    return qk * cos.unsqueeze(2) + _rotate_half(qk) * sin.unsqueeze(2)


def _compiled_parts() -> tuple[Callable[..., torch.Tensor], ...]:
    """The norm, SiLU and rotary parts compiled for a GPU, with the signatures of the torch
    versions above.

    Each compiled function sees 2-D rows (rows x tokens flattened) and never ``None``: dynamic
    shapes still specialise a size of 1 and the type of every argument, so on the original
    shapes the decode widths, the prefill and the first layer's missing residual made more
    than dynamo's 8 variants a function, and capture failed past them."""
    norm = torch.compile(_rms_norm_rows, dynamic=True, fullgraph=True)
    add_norm = torch.compile(_add_rms_norm_rows, dynamic=True, fullgraph=True)
    silu = torch.compile(_silu_mul, dynamic=True, fullgraph=True)
    rope = torch.compile(_rope_rows, dynamic=True, fullgraph=True)

    def add_rms_norm(
        hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        rows = hidden.view(-1, hidden.shape[-1])
        if delta is None:
            return norm(rows, weight, eps).view(hidden.shape)
        return add_norm(rows, delta.reshape(rows.shape), weight, eps).view(hidden.shape)

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        out = silu(gate_up.reshape(-1, gate_up.shape[-1]))
        return out.view(*gate_up.shape[:-1], out.shape[-1])

    def rope_parts(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows = qk.view(-1, *qk.shape[-2:])
        dim = cos.shape[-1]
        return rope(rows, cos.reshape(-1, dim), sin.reshape(-1, dim)).view(qk.shape)

    return add_rms_norm, silu_mul, rope_parts


def _rms_norm_rows(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def _add_rms_norm_rows(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    hidden.add_(delta)
    return _rms_norm_rows(hidden, weight, eps)


def _rope_rows(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``_rope`` over ``[rows, heads, dim]`` with ``[rows, dim]`` cos/sin."""
    return qk * cos.unsqueeze(1) + _rotate_half(qk) * sin.unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
