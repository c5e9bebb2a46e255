"""Sequence packing: variable-length samples into padding-free micro-batches.

Each ``MicroBatch`` is all its sequences concatenated into one row of ``N`` tokens, with
``position_ids`` restarting at 0 for each sequence and ``cu_seqlens`` marking the boundaries.

How the model keeps packed sequences apart: pass ``input_ids[None]`` and
``position_ids[None]`` with ``attention_mask=None`` and ``use_cache=False``
(``MicroBatch.model_inputs()``). Transformers 5 (``masking_utils.find_packed_sequence_indices``)
reads the restarts in ``position_ids`` and builds a block-diagonal causal mask for the sdpa,
eager and flex attention paths; flash-attention 2/3 derives ``cu_seqlens`` from the same
``position_ids``. So ``position_ids`` alone isolate the sequences; ``attention_mask`` must stay
``None`` (a 2-D mask switches the detection off) and so must the cache (``use_cache=False``).
``tests/test_packing.py`` checks the logits equal those of each sequence run alone.

Alignment: every per-token tensor is indexed like ``input_ids``; the value at ``t`` refers to
token ``input_ids[t]``, predicted by the model's logits at ``t - 1``. The first token of each
sequence has no prediction inside the micro-batch, so its ``loss_mask`` is always 0.

Shared prefixes (``share_prefixes=True``): the samples of one group usually start with the
same prompt. Its tokens then go into the micro-batch once, as a segment of their own, and
each member's segment holds only the rest, from the prompt's last token on (whose logits
predict the member's first sampled token), with positions continuing after the prefix.
``MicroBatch.parents`` names each segment's prefix segment (-1: none) and the ``varlen``
attention lets a member's queries see its prefix's keys: the logits, the loss and the
gradients are those of the members run whole (``tests/test_packing.py``). Only tokens that
no member was trained on are shared. A GRPO group of 8 completions of 16 tokens after an
89-token prompt packs as 89 + 8 x 17 = 225 tokens instead of 8 x 105 = 840.

Bin packing: first-fit-decreasing finds how many micro-batches the token budget needs; that
count is rounded up to a multiple of ``num_ranks`` (every rank must run the same number of
forward/backward passes, or collective ops hang). The samples are then spread over that many
micro-batches by worst-fit-decreasing (longest first into the emptiest micro-batch that
fits), which evens out their token counts; where that does not fit, FFD's own packing is
kept (samples moved from shared micro-batches into any extra ones). Micro-batches go to ranks the same way, so ranks
get similar token totals. A rank short of samples gets a one-token padding micro-batch with
nothing to train (``loss_mask`` 0), never an empty one.

>>> from areal_sdk.samples import TrainingSample
>>> s = TrainingSample("e", "g", "t", ["u"], [5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.2], [-1, 3, 3], 1.0)
>>> [[mb.input_ids.tolist() for mb in rank] for rank in pack_samples([s], [0.5], max_tokens=8)]
[[[5, 6, 7]]]
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_sdk.samples import NO_LOGPROB, NO_VERSION, TrainingSample


@dataclass
class MicroBatch:
    """Packed sequences for one forward/backward pass. See the module docstring."""

    input_ids: torch.Tensor  # [N] int64, all sequences concatenated, no padding
    position_ids: torch.Tensor  # [N] int64, restarting at 0 for each sequence
    cu_seqlens: torch.Tensor  # [S+1] int32 sequence boundaries
    loss_mask: torch.Tensor  # [N] float32, 1 where input_ids[t] was sampled by the policy
    behaviour_logprobs: torch.Tensor  # [N] float32, engine logprobs (0 where mask 0)
    versions: torch.Tensor  # [N] int64, -1 where mask 0
    advantages: torch.Tensor  # [N] float32, a sequence's advantage broadcast to its tokens
    proximal_logprobs: torch.Tensor | None = None  # [N], filled by the trainer before the update
    ref_logprobs: torch.Tensor | None = None  # [N], reference model, when a KL term is used
    sample_indices: list[int] = field(default_factory=list)  # which input samples are in here
    # [S] int32: the segment whose tokens each segment continues (-1: none); None when no
    # segment has a shared prefix.
    parents: torch.Tensor | None = None
    # [R] int64: the rows whose predictions the loss reads (row t - 1 for every token t with
    # loss_mask > 0), then the last row; the policy runs its vocabulary head on these rows
    # only and gives the others logprob 0. None: every row.
    head_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on ``device``."""
        moved: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return MicroBatch(**moved)

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM forward over the packed row."""
        return {
            "input_ids": self.input_ids.unsqueeze(0),
            "position_ids": self.position_ids.unsqueeze(0),
            "attention_mask": None,
            "use_cache": False,
        }


def _check(sample: TrainingSample, index: int, max_tokens: int) -> None:
    name = f"sample {index} (episode {sample.episode_id}, turns {sample.turn_ids})"
    n = len(sample.input_ids)
    if n == 0:
        raise ValueError(f"{name} has no tokens")
    if n > max_tokens:
        raise ValueError(
            f"{name} has {n} tokens, more than the micro-batch budget of {max_tokens} "
            "(raise train.micro_batch_tokens or cap the episode length)"
        )
    for attr in ("loss_mask", "logprobs", "versions"):
        if len(getattr(sample, attr)) != n:
            raise ValueError(
                f"{name}: {attr} has {len(getattr(sample, attr))} entries, input_ids has {n}"
            )


def _first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices per bin: longest first, each into the first bin with room (fewest bins)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def _worst_fit_decreasing(
    lengths: Sequence[int], n_bins: int, capacity: int
) -> list[list[int]] | None:
    """Indices per bin: longest first, each into the emptiest bin with room; None if stuck."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    load = [0] * n_bins
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(n_bins) if load[b] + lengths[i] <= capacity]
        if not fits:
            return None
        b = min(fits, key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += lengths[i]
    return bins


def _fill_empty_bins(bins: list[list[int]], lengths: Sequence[int], n_bins: int) -> list[list[int]]:
    """Pad ``bins`` to ``n_bins``, moving the shortest sample of the heaviest shared bin into
    each new one (a single sample always fits an empty bin)."""
    bins = [list(b) for b in bins] + [[] for _ in range(n_bins - len(bins))]
    for empty in (b for b in bins if not b):
        donors = [b for b in bins if len(b) > 1]
        if not donors:
            break
        donor = max(donors, key=lambda b: sum(lengths[i] for i in b))
        shortest = min(donor, key=lambda i: lengths[i])
        donor.remove(shortest)
        empty.append(shortest)
    return bins


def _assign_to_ranks(
    bins: list[list[int]], lengths: Sequence[int], num_ranks: int
) -> list[list[list[int]]]:
    """Equal bin counts per rank, heaviest bins first onto the lightest rank with room."""
    per_rank = len(bins) // num_ranks
    ranks: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    weight = [sum(lengths[i] for i in b) for b in bins]
    for b in sorted(range(len(bins)), key=lambda b: (-weight[b], b)):
        r = min(
            (r for r in range(num_ranks) if len(ranks[r]) < per_rank), key=lambda r: (load[r], r)
        )
        ranks[r].append(bins[b])
        load[r] += weight[b]
    return ranks


def _concat(parts: Iterable[Sequence[float]], dtype: torch.dtype) -> torch.Tensor:
    """The parts end to end as one 1-D tensor, through an ``array`` (``torch.tensor`` on
    Python numbers is several times slower)."""
    buffer = array("q" if dtype == torch.long else "f")
    for part in parts:
        if isinstance(part, list):
            buffer.fromlist(part)
        else:
            buffer.extend(part)
    return torch.frombuffer(buffer, dtype=dtype)


# A prefix shorter than this stays in each member: its own segment would save less than
# the per-segment work of attention costs.
MIN_SHARED_PREFIX = 8


@dataclass
class _Unit:
    """What bin packing places: one sample, or a group's members behind their shared
    prefix of ``shared`` tokens (0: none)."""

    members: list[int]
    shared: int
    size: int


def _shared_prefix(samples: Sequence[TrainingSample], members: list[int]) -> int:
    """How many leading tokens ``members`` can share: their common prefix, up to the first
    token any of them trains on, less the last (each member keeps it: its logits predict the
    member's first sampled token)."""
    first = [samples[i] for i in members]
    limit = min(next((t for t, m in enumerate(s.loss_mask) if m), len(s.input_ids)) for s in first)
    ids = first[0].input_ids
    common = 0
    while common < limit and all(s.input_ids[common] == ids[common] for s in first[1:]):
        common += 1
    return max(common - 1, 0)


def _units(samples: Sequence[TrainingSample], max_tokens: int, share_prefixes: bool) -> list[_Unit]:
    """Each sample alone, or with ``share_prefixes`` each group behind its shared prefix
    (split into several units, each with the prefix, where one would exceed ``max_tokens``)."""
    lengths = [len(s.input_ids) for s in samples]
    groups: dict[str, list[int]] = {}
    alone: list[int] = []
    for i, s in enumerate(samples):
        if share_prefixes and s.group_id is not None:
            groups.setdefault(s.group_id, []).append(i)
        else:
            alone.append(i)
    units = [_Unit([i], 0, lengths[i]) for i in alone]
    for members in groups.values():
        shared = _shared_prefix(samples, members) if len(members) > 1 else 0
        if shared < MIN_SHARED_PREFIX:
            units += [_Unit([i], 0, lengths[i]) for i in members]
            continue
        # First-fit-decreasing of the members' own parts into units of one prefix each.
        parts: list[_Unit] = []
        for i in sorted(members, key=lambda i: (-lengths[i], i)):
            own = lengths[i] - shared
            unit = next((u for u in parts if u.size + own <= max_tokens), None)
            if unit is None:
                parts.append(_Unit([i], shared, shared + own))
            else:
                unit.members.append(i)
                unit.size += own
        for unit in parts:
            unit.members.sort()
            if len(unit.members) == 1:  # nothing left to share with
                unit.shared, unit.size = 0, lengths[unit.members[0]]
        units += parts
    return units


@dataclass
class _Segment:
    """A sample's tokens from ``start`` on (the sample's ``advantage`` index ``index``), or with
    ``index`` -1 a group's shared prefix: the sample's first ``end`` tokens, trained on by none."""

    sample: TrainingSample
    start: int
    end: int
    parent: int
    index: int

    def values(self, attr: str) -> list[Any]:
        if self.index < 0 and attr != "input_ids":
            return [0] * self.end
        return getattr(self.sample, attr)[self.start : self.end]


def _build(
    samples: Sequence[TrainingSample], advantages: Sequence[float], units: list[_Unit]
) -> MicroBatch:
    # Per-element Python over a 32k-token micro-batch took ~15 ms, time the GPU waits at
    # the start of every step: one buffer per field, the rest as tensor ops.
    segments: list[_Segment] = []
    for unit in units:
        parent = -1
        if unit.shared:
            parent = len(segments)
            segments.append(_Segment(samples[unit.members[0]], 0, unit.shared, -1, -1))
        for i in unit.members:
            segments.append(_Segment(samples[i], unit.shared, len(samples[i].input_ids), parent, i))
    lengths = torch.tensor([g.end - g.start for g in segments], dtype=torch.long)
    bounds = torch.zeros(len(segments) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=bounds[1:])
    starts = bounds[:-1].long()
    # Each token's segment index as a running sum (``repeat_interleave`` is slow on CPU),
    # its position from its segment's start (a member after a prefix continues from it).
    n = int(bounds[-1])
    seq = torch.zeros(n, dtype=torch.long)
    seq[starts[1:]] = 1
    seq = seq.cumsum(0)
    offset = torch.tensor([g.start for g in segments], dtype=torch.long)
    pos = torch.arange(n) - starts[seq] + offset[seq]

    def column(attr: str, dtype: torch.dtype) -> torch.Tensor:
        return _concat((g.values(attr) for g in segments), dtype)

    # The first token is never predicted inside the row, so it cannot be trained on.
    mask = column("loss_mask", torch.float32)
    mask[starts] = 0.0
    keep = mask != 0
    logp = column("logprobs", torch.float32)
    vers = column("versions", torch.long)
    adv = torch.tensor(
        [float(advantages[g.index]) if g.index >= 0 else 0.0 for g in segments],
        dtype=torch.float32,
    )
    parents = [g.parent for g in segments]
    return MicroBatch(
        input_ids=column("input_ids", torch.long),
        position_ids=pos,
        cu_seqlens=bounds,
        loss_mask=mask,
        behaviour_logprobs=torch.where(keep, logp, NO_LOGPROB),
        versions=torch.where(keep, vers, NO_VERSION),
        advantages=adv[seq],
        sample_indices=[g.index for g in segments if g.index >= 0],
        parents=torch.tensor(parents, dtype=torch.int32) if max(parents) >= 0 else None,
        head_rows=rows_predicting(mask),
    )


def rows_predicting(loss_mask: torch.Tensor) -> torch.Tensor:
    """``MicroBatch.head_rows`` of a packed row with this ``loss_mask``.

    Prompt and observation tokens are never trained on, so their logits are never read: in
    agent episodes they are often most of the row. The last row is always kept, so even a
    row with nothing to train runs the head and gives its weight a (zero) gradient, as every
    rank of ZeRO-2/3 must.
    """
    n = loss_mask.numel()
    trained = torch.nonzero(loss_mask[1:] > 0).squeeze(1)
    return torch.cat([trained, torch.tensor([n - 1], dtype=torch.long)])


def _padding(token: int) -> MicroBatch:
    """A one-token micro-batch with nothing to train, so every rank runs the same passes."""
    return MicroBatch(
        input_ids=torch.tensor([token], dtype=torch.long),
        position_ids=torch.zeros(1, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        loss_mask=torch.zeros(1, dtype=torch.float32),
        behaviour_logprobs=torch.zeros(1, dtype=torch.float32),
        versions=torch.full((1,), NO_VERSION, dtype=torch.long),
        advantages=torch.zeros(1, dtype=torch.float32),
        head_rows=torch.zeros(1, dtype=torch.long),
    )


def pack_samples(
    samples: Sequence[TrainingSample],
    advantages: Sequence[float],
    max_tokens: int,
    *,
    num_ranks: int = 1,
    share_prefixes: bool = False,
) -> list[list[MicroBatch]]:
    """Pack samples into micro-batches of at most ``max_tokens`` tokens, per rank.

    With ``share_prefixes`` a group's common prompt is packed once (see the module
    docstring); only the ``varlen`` attention reads ``MicroBatch.parents``.

    Returns ``num_ranks`` lists of equal length. ``advantages[i]`` is sample ``i``'s scalar
    advantage. Raises ``ValueError`` for a sample over the budget (naming it) or mismatched
    lengths. When the samples cannot fill every rank's share (fewer samples than
    micro-batches), the gaps are one-token micro-batches with ``loss_mask`` 0 and no
    ``sample_indices``: they add nothing to the loss but keep the ranks' collectives in step.
    """
    if max_tokens < 1 or num_ranks < 1:
        raise ValueError(f"max_tokens ({max_tokens}) and num_ranks ({num_ranks}) must be >= 1")
    if len(advantages) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    if not samples:
        raise ValueError("no samples to pack")
    for i, s in enumerate(samples):
        _check(s, i, max_tokens)
    units = _units(samples, max_tokens, share_prefixes)
    lengths = [u.size for u in units]
    tight = _first_fit_decreasing(lengths, max_tokens)
    n_bins = -(-max(len(tight), num_ranks) // num_ranks) * num_ranks
    # Balanced when even spreading fits; otherwise FFD's tight packing, so a balance
    # heuristic never costs an extra forward/backward pass.
    bins = _worst_fit_decreasing(lengths, n_bins, max_tokens)
    if bins is None:
        bins = _fill_empty_bins(tight, lengths, n_bins)
    ranks = _assign_to_ranks(bins, lengths, num_ranks)
    pad_token = samples[0].input_ids[0]
    return [
        [
            _build(
                samples, advantages, [units[u] for u in sorted(b, key=lambda u: units[u].members)]
            )
            if b
            else _padding(pad_token)
            for b in rank
        ]
        for rank in ranks
    ]
