"""The policy as both train backends run it: an HF causal LM that returns token logprobs.

``PackedPolicy`` wraps a Hugging Face ``AutoModelForCausalLM`` so that its ``forward`` takes
one packed micro-batch (``input_ids`` and ``position_ids`` of shape ``[N]``) and returns the
logprob (and entropy) of every token given the tokens before it in its sequence. The
vocabulary projection goes through ``areal_sdk.logprobs.token_logprobs_and_entropy`` on the
final hidden states, chunked, so ``[N, V]`` float32 logits never exist at once.

The HF ``lm_head`` is replaced by ``LogprobHead``, which holds the *same* parameter (tied
embeddings stay tied) but computes logprobs instead of logits. Keeping the projection inside
a submodule's ``forward`` matters under ZeRO-3: DeepSpeed gathers a module's partitioned
parameters when that module runs, forward and backward, so the head weight is whole exactly
while it is used.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from areal_sdk.backends.train import varlen_attention
from torch import nn

# HF names are the wrapped model's names without this prefix.
POLICY_PREFIX = "policy."


class LogprobHead(nn.Module):
    """The output projection, computing per-token logprobs and entropy of given labels."""

    def __init__(self, weight: nn.Parameter, backend: str = "auto") -> None:
        super().__init__()
        self.weight = weight
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        with_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from areal_sdk.logprobs import token_logprobs_and_entropy

        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            # Under autocast the HF lm_head would run in the autocast dtype; so does this
            # projection (the residual stream, and so ``hidden``, stays float32). The float32
            # master weight goes in as it is and gets its float32 gradient straight back.
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = hidden.dtype
        return token_logprobs_and_entropy(
            hidden,
            self.weight,
            labels,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            backend=self.backend,
            compute_dtype=dtype,
        )


class PackedPolicy(nn.Module):
    """An HF causal LM whose forward maps a packed row to aligned token logprobs."""

    def __init__(
        self,
        policy: nn.Module,
        *,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        logprob_backend: str = "auto",
        padded_attention: bool = False,
        varlen_attention: bool = False,
        varlen_kernel: str = "auto",
    ):
        super().__init__()
        head = policy.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("output projections with a bias are not supported")
        policy.set_output_embeddings(LogprobHead(head.weight, logprob_backend))
        self.policy = policy
        self.temperature = temperature if temperature > 0 else 1.0
        self.chunk_size = chunk_size
        self.padded_attention = padded_attention
        self.varlen_attention = varlen_attention
        self.varlen_kernel = varlen_kernel

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        with_entropy: bool = True,
        parents: torch.Tensor | None = None,
        head_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs ``[N]`` (and entropy ``[N]``), value t for token t given tokens < t.

        Each sequence's first token has no prediction inside the row: it gets 0.
        ``parents`` (``MicroBatch.parents``): sequences that continue a shared prefix in the
        row; needs ``varlen`` attention. ``head_rows`` (``MicroBatch.head_rows``): the rows
        the vocabulary head runs on; tokens predicted by the other rows get 0.
        """
        hidden = self._hidden_states(input_ids, position_ids, cu_seqlens, parents)
        # Row t-1 predicts token t. The last row (predicting past the end) is computed and
        # dropped, so even a one-token padding micro-batch runs the head and gives every
        # parameter a (zero) gradient: ranks of ZeRO-2/3 must all reduce the same gradients.
        head = self.policy.get_output_embeddings()
        labels = torch.roll(input_ids, -1)
        if head_rows is None:
            lp_all, ent_all = head(hidden, labels, self.temperature, self.chunk_size, with_entropy)
        else:
            lp_all, ent_all = self._head_on_rows(head, hidden, labels, head_rows, with_entropy)
        lp_rows = lp_all[:-1]
        ent_rows = None if ent_all is None else ent_all[:-1]
        starts = torch.zeros(input_ids.numel(), dtype=torch.bool, device=input_ids.device)
        starts[cu_seqlens[:-1].long()] = True
        keep = ~starts[1:]
        zero = lp_rows.new_zeros(1)
        logprobs = torch.cat([zero, torch.where(keep, lp_rows, 0.0)])
        entropy = None
        if ent_rows is not None:
            entropy = torch.cat([zero, torch.where(keep, ent_rows, 0.0)])
        return logprobs, entropy

    def _head_on_rows(
        self,
        head: nn.Module,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        rows: torch.Tensor,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's ``[N]`` outputs computed on ``rows`` only, 0 elsewhere."""
        lp_rows, ent_rows = head(
            hidden.index_select(0, rows),
            labels.index_select(0, rows),
            self.temperature,
            self.chunk_size,
            with_entropy,
        )
        n = hidden.shape[0]
        lp_all = lp_rows.new_zeros(n).index_copy(0, rows, lp_rows)
        ent_all = None if ent_rows is None else ent_rows.new_zeros(n).index_copy(0, rows, ent_rows)
        return lp_all, ent_all

    def _hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        parents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[N, H]`` of the packed row.

        ``varlen_attention`` (``attn_implementation: varlen``) hands the sequence boundaries
        to the attention kernel, which attends within each sequence at the cost of its own
        length squared; on CUDA, when the sequences are of similar length, cuDNN runs them
        as a padded batch instead (``train.varlen_kernel``, ``varlen_attention.
        padded_layout``). ``padded_attention`` runs the sequences as a right-padded ``[S, L]``
        batch: causal attention never looks at the padding after a sequence, so no mask is
        needed and SDPA can take its flash path at S x L^2 cost, where one packed row with a
        block-diagonal mask costs N^2; the price is the padding's share of every other layer.
        Otherwise the row runs as is (transformers builds the block-diagonal mask from
        ``position_ids``; flash-attention 2 reads them directly).
        """
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if parents is not None and not self.varlen_attention:
            raise ValueError(
                "a micro-batch with shared prefixes needs train.attn_implementation: varlen"
            )
        if self.varlen_attention:
            sizes = lengths.tolist()  # one host sync per micro-batch, not per layer
            prefix = None if parents is None else varlen_attention.prefix_keys(cu_seqlens, parents)
            padded = None
            if prefix is None:
                padded = varlen_attention.padded_layout(cu_seqlens, sizes, self.varlen_kernel)
            return self.policy.base_model(
                input_ids=input_ids[None],
                position_ids=position_ids[None],
                attention_mask=None,
                use_cache=False,
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens if prefix is None else prefix.cu_seqlens_k,
                max_length_q=max(sizes),
                max_length_k=max(sizes) if prefix is None else prefix.max_len_k,
                varlen_padded=padded,
                varlen_prefix_index=None if prefix is None else prefix.index,
            ).last_hidden_state[0]
        if not self.padded_attention or lengths.numel() <= 1:
            return self.policy.base_model(
                input_ids=input_ids[None],
                position_ids=position_ids[None],
                attention_mask=None,
                use_cache=False,
            ).last_hidden_state[0]
        device = input_ids.device
        lengths = lengths.to(device=device, dtype=torch.long)
        n_seqs, longest = lengths.numel(), int(lengths.max())
        row = torch.repeat_interleave(torch.arange(n_seqs, device=device), lengths)
        col = torch.arange(input_ids.numel(), device=device) - cu_seqlens[:-1].to(device)[row]
        ids = input_ids.new_zeros((n_seqs, longest))
        ids[row, col] = input_ids
        pos = torch.arange(longest, device=device).expand(n_seqs, longest).clone()
        pos[row, col] = position_ids
        hidden = self.policy.base_model(
            input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False
        ).last_hidden_state
        return hidden[row, col]


def load_policy(
    path: str | Path,
    *,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    dtype: torch.dtype = torch.float32,
    logprob_backend: str = "auto",
    padded_attention: bool = False,
    compile_layers: bool = False,
    varlen_kernel: str = "auto",
) -> PackedPolicy:
    """Load a local HF directory as a ``PackedPolicy`` (never touches a hub); weights that
    do not fit its config raise ``WeightMismatchError``."""
    from areal_sdk.models import load_causal_lm

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    varlen = attn_implementation == varlen_attention.NAME
    if varlen:
        varlen_attention.register()
    model = load_causal_lm(path, dtype=dtype, attn_implementation=attn_implementation)
    model.config.use_cache = False
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with ZeRO-3 hooks and inputs without grad.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if compile_layers:
        compile_decoder_layers(model)
    model.train()
    return PackedPolicy(
        model,
        temperature=temperature,
        chunk_size=chunk_size,
        logprob_backend=logprob_backend,
        # varlen and flash-attention 2 separate packed sequences themselves, unpadded.
        padded_attention=padded_attention
        and not varlen
        and attn_implementation != "flash_attention_2",
        varlen_attention=varlen,
        varlen_kernel=varlen_kernel,
    )


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile`` every decoder layer in place; returns how many were compiled.

    Per layer rather than the whole model: the layers share one graph (compiled once, reused
    by all, in seconds), the vocabulary head and the loss stay outside, and checkpointing and
    ZeRO-3 hooks wrap a layer exactly as before. The whole decoder as one graph was measured
    no faster on an H200 and took 200 s to compile. Shapes are dynamic because every packed
    micro-batch has its own length.
    """
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"train.compile needs a decoder with a `layers` list; {type(model).__name__} has none"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def hf_name(name: str) -> str:
    """``policy.model.layers.0...`` -> ``model.layers.0...`` (the name in the HF checkpoint)."""
    return name.removeprefix(POLICY_PREFIX)


@torch.no_grad()
def assign_weights(
    named: list[tuple[str, nn.Parameter]], weights: Mapping[str, torch.Tensor], source: Path
) -> None:
    """Copy ``weights`` (HF names) into the parameters ``named``, which must be exactly the
    names the file holds: a checkpoint never half-loads."""
    from areal_sdk.models import WeightMismatchError

    expected = {name for name, _ in named}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise WeightMismatchError(
            f"the weights in {source} do not fit this model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    for name, param in named:
        if weights[name].shape != param.shape:
            raise WeightMismatchError(
                f"{source}: {name} has shape {tuple(weights[name].shape)}, the model "
                f"{tuple(param.shape)}"
            )
        param.copy_(weights[name])


def plan_buckets(sizes: Iterable[int], bucket_bytes: int) -> list[list[int]]:
    """Group consecutive items into buckets of at most ``bucket_bytes`` (an item larger than
    that gets a bucket of its own). Returns the item indices of each bucket, in order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if current and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        buckets.append(current)
    return buckets


def read_step_metrics(
    parts: list[tuple[float, Mapping[str, float | torch.Tensor]]], losses: list[torch.Tensor]
) -> tuple[list[tuple[float, dict[str, float]]], float]:
    """The micro-batches' metrics as floats and the step loss (sum of share x loss), read
    from the device in one copy once the whole step is queued."""
    from areal_sdk.algorithms import metric_values

    flat: dict[tuple[int, str], float | torch.Tensor] = {
        (i, key): value for i, (_, metrics) in enumerate(parts) for key, value in metrics.items()
    }
    flat.update({(-1 - i, "loss"): loss.detach() for i, loss in enumerate(losses)})
    values = metric_values(flat)
    step_loss = sum(share * values[(-1 - i, "loss")] for i, (share, _) in enumerate(parts))
    read = [
        (share, {key: values[(i, key)] for key in metrics})
        for i, (share, metrics) in enumerate(parts)
    ]
    return read, step_loss


def merge_metrics(parts: list[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """Combine per-micro-batch metrics: ``n_*`` summed, ``*_max`` maxed, the rest averaged
    with the micro-batches' loss shares (micro-batches with no share are left out)."""
    out: dict[str, float] = {}
    keys = {k for _, m in parts for k in m}
    for key in sorted(keys):
        values = [(share, float(m[key])) for share, m in parts if key in m]
        if key.startswith("n_"):
            out[key] = sum(v for _, v in values)
        elif key.endswith("_max"):
            out[key] = max(v for _, v in values)
        else:
            total = sum(share for share, _ in values)
            if total > 0:
                out[key] = sum(share * v for share, v in values) / total
    return out
