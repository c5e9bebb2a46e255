"""AdamW for the ``torch`` train backend, its two moments kept in float32 or bfloat16.

The moments are two copies of the weights' size: in float32, 1.08 GB of the quickstart's
SmolLM2-135M, its largest share after the engine. ``train.optimizer_state_dtype: bfloat16``
stores them in half of that, as DeepSeek-V3 does, with the update itself still in float32:
each parameter's moments are upcast, updated by torch's own (fused) AdamW kernel and stored
back, so only one parameter's float32 moments exist at a time.

>>> optimizer = build_adamw(model.parameters(), TrainConfig(), torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam

from areal_sdk.config import TrainConfig

MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_state_dtype(setting: str, device: torch.device) -> torch.dtype:
    """``train.optimizer_state_dtype`` for ``device``: ``auto`` is float32 (exact AdamW, what
    the other backends and every comparison assume); bfloat16 is the memory saver a laptop
    run asks for (the quickstart does)."""
    if setting == "auto":
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]


def build_adamw(
    params: Iterable[torch.nn.Parameter], cfg: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW over ``params`` as ``cfg`` asks, fused on CUDA and CPU (one kernel for the whole
    update; on CPU 4x faster for SmolLM2 and no temporaries the size of a parameter)."""
    kwargs: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": tuple(cfg.betas),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "fused": device.type in ("cuda", "cpu"),
    }
    state_dtype = optimizer_state_dtype(cfg.optimizer_state_dtype, device)
    if state_dtype == torch.float32:
        return torch.optim.AdamW(params, **kwargs)
    return CompactAdamW(params, state_dtype=state_dtype, **kwargs)


# Random bits for the rounding are drawn once a step into a pool, and each tensor takes
# windows of it at random offsets. torch draws CPU random numbers on one thread, about 4 ns
# each: a fresh draw per element took 1.0 of a 6.3 s SmolLM2-135M training step on the
# 2-core development machine, the pool 16 ms. Every element still gets new bits each step
# (the pool is redrawn); elements a window apart in one step may share theirs, which leaves
# each one's rounding unbiased.
NOISE_POOL = 1 << 22
NOISE_WINDOW = NOISE_POOL // 2


class RoundingNoise:
    """Uniform 16-bit random integers for ``store_rounded``, redrawn by ``refresh``."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        # Seeded: two runs of the same steps give the same weights. The offsets are drawn on
        # the host, so a CUDA pool costs no device round trip per window.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.offsets = random.Random(seed)
        self.device = device
        self.pool: torch.Tensor | None = None

    def refresh(self) -> None:
        self.pool = torch.randint(
            0,
            1 << 16,
            (NOISE_POOL,),
            dtype=torch.int32,
            device=self.device,
            generator=self.generator,
        )

    def window(self, n: int) -> torch.Tensor:
        """``n`` (at most ``NOISE_WINDOW``) values of the pool from a random offset."""
        if self.pool is None:
            self.refresh()
        assert self.pool is not None and n <= NOISE_WINDOW
        start = self.offsets.randrange(NOISE_POOL - n + 1)
        return self.pool[start : start + n]


def store_rounded(
    source: torch.Tensor, out: torch.Tensor, noise: RoundingNoise | None = None
) -> None:
    """Store float32 ``source`` in ``out``; into bfloat16 with stochastic rounding.

    Rounded to nearest, a moment stops moving once its change per step is under half a
    bfloat16 step (2^-9 of its value): with beta2 = 0.999 the second moment changes by 0.1%
    a step, so it froze wherever it stood. Rounding up with probability equal to the distance
    keeps every update in expectation: add 16 random bits below bfloat16's last bit of the
    float32 pattern, then cut them off (the cut value is exact in bfloat16)."""
    if out.dtype != torch.bfloat16 or source.dtype != torch.float32:
        out.copy_(source)
        return
    noise = noise or RoundingNoise(source.device)
    bits = source.contiguous().view(-1).view(torch.int32)
    stored = out.view(-1)
    for start in range(0, bits.numel(), NOISE_WINDOW):
        part = bits[start : start + NOISE_WINDOW]
        rounded = noise.window(part.numel()).add(part).bitwise_and_(-(1 << 16))
        stored[start : start + part.numel()].copy_(rounded.view(torch.float32))


class CompactAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose moments are stored in ``state_dtype`` (bfloat16).

    Each step upcasts one parameter's moments to float32, runs torch's AdamW update on them
    and stores them back with stochastic rounding (``store_rounded``). Checkpoints hold the stored dtype; a float32
    checkpoint loads too (its moments are rounded).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        state_dtype: torch.dtype = torch.bfloat16,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, **kwargs)
        self.state_dtype = state_dtype
        self._noise: dict[torch.device, RoundingNoise] = {}

    def _rounding(self, device: torch.device) -> RoundingNoise:
        if device not in self._noise:
            self._noise[device] = RoundingNoise(device)
        return self._noise[device]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for noise in self._noise.values():
            noise.refresh()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                    for key in MOMENTS:
                        state[key] = torch.zeros_like(param, dtype=self.state_dtype)
                exp_avg = state["exp_avg"].float()
                exp_avg_sq = state["exp_avg_sq"].float()
                adam(
                    [param],
                    [param.grad],
                    [exp_avg],
                    [exp_avg_sq],
                    [],
                    [state["step"]],
                    foreach=group["foreach"],
                    fused=group["fused"],
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=group["maximize"],
                )
                store_rounded(exp_avg, state["exp_avg"], self._rounding(param.device))
                store_rounded(exp_avg_sq, state["exp_avg_sq"], self._rounding(param.device))
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts loaded state to each parameter's dtype (float32): store it compact again.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in MOMENTS:
                if key in state:
                    state[key] = state[key].to(self.state_dtype)
