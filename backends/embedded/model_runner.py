"""Runs a transformers causal LM over ragged batches against the slot KV cache.

The model's modules are used as they are; only attention is swapped for ``areal_slots``
(see ``kv_cache``). ``forward`` takes rows of new tokens, each row belonging to one slot and
starting at that slot's next position, and returns float32 logits for the positions the
caller asks for. On CUDA, decode steps (one token per row, rows = slots ``0..B-1``) replay
CUDA graphs captured per batch-size bucket and cache-length bucket, which removes the
per-layer launch overhead. The cache-length bucket matters as much as the batch one: a decode
step's attention reads every row's cache up to the graph's length, so a graph over the whole
``max_len`` makes each step cost rows x max_len however short the sequences are, and more
concurrent requests then buy no throughput.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch
from areal_sdk.backends.embedded import cpu_kernels
from areal_sdk.backends.embedded.fused_decoder import FusedDecoder
from areal_sdk.backends.embedded.fused_decoder import supports as fused_decoder_supported
from areal_sdk.backends.embedded.kv_cache import (
    ATTN_IMPLEMENTATION,
    PackedRows,
    SlotKVCache,
    StepContext,
)
from areal_sdk.backends.embedded.packed_linear import (
    PackedLinears,
    SoleCopies,
    packed_linear_available,
)
from areal_sdk.backends.embedded.sampler import sample_temperature
from areal_sdk.backends.embedded.transfer import to_device
from areal_sdk.backends.embedded.weights import WeightSource, load_into, own_memory
from areal_sdk.backends.train.varlen_attention import flash_available

log = logging.getLogger(__name__)


@dataclass
class RowInput:
    """One row of a step: ``tokens`` fed to ``slot`` starting at position ``start``."""

    slot: int
    start: int
    tokens: list[int]


def _text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class ModelRunner:
    """Owns the model's KV cache and runs its forward passes.

    >>> runner = ModelRunner(model, num_slots=8, max_len=512)
    >>> logits = runner.forward([RowInput(slot=0, start=0, tokens=[1, 2, 3])])  # [1, vocab]
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_slots: int,
        max_len: int,
        cuda_graphs: bool | None = None,
        packed_prefill: bool | None = None,
        packed_weights: bool | None = None,
        fused_decoder: bool | None = None,
        flash_decode: bool | None = None,
    ) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        cfg = _text_config(model)
        self.vocab_size = int(cfg.vocab_size)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._set_attention(model)
        if packed_weights is None:
            packed_weights = packed_linear_available(self.device, self.dtype)
        if fused_decoder is None:
            # On CUDA its parts compile through Triton: without it they would not build.
            compiles = self.device.type == "cpu" or importlib.util.find_spec("triton") is not None
            fused_decoder = compiles and fused_decoder_supported(model)
        self.fused = FusedDecoder(model, packed=packed_weights) if fused_decoder else None
        skip = self.fused.fused_linears if self.fused is not None else []
        self.packed_linears = PackedLinears(model, skip=skip) if packed_weights else None
        # The stacked and packed weights are the copies the forward reads: the layers' own
        # weights go, rather than sit beside them (the engine's weights held once).
        stacks = [*(self.fused.stacks if self.fused is not None else [])]
        if self.packed_linears is not None:
            stacks += self.packed_linears.stacks.values()
        self.sole_copies = SoleCopies(model, stacks)
        if self.device.type == "cpu":
            own_memory(model)  # the weights file's mapping goes (weights.own_memory)
        # Built (or loaded from its cache) now rather than in the first decode step.
        self._cpu_kernels = self.device.type == "cpu" and cpu_kernels.available()
        # Prefill rows packed into one row for the flash varlen kernel (CUDA, half precision):
        # no padding to the longest row, no dense mask over each prefix.
        self._flash = flash_available(self.device) and self.dtype in (
            torch.float16,
            torch.bfloat16,
        )
        self.packed_prefill = self._flash if packed_prefill is None else packed_prefill
        # Decode rows attend over their own prefixes through the flash kernel (kv_cache.py)
        # rather than a masked SDPA over the cache bucket: with the fused decoder 1.50x the
        # output tokens/s at 256 rows on an H100 (benchmarks/engine.md).
        self.flash_decode = (
            self._flash if flash_decode is None else bool(flash_decode) and self._flash
        )
        self.cache = SlotKVCache(
            num_layers=cfg.num_hidden_layers,
            num_slots=num_slots,
            max_len=max_len,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.num_slots = num_slots
        self.max_len = max_len
        self._backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self._lm_head = model.get_output_embeddings()
        self._positions = torch.arange(max_len + 1, device=self.device)
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        # Decode rows are slots 0..width-1: their indices, apart from the positions above
        # (there may be more slots than positions).
        self._slot_ids = torch.arange(num_slots, device=self.device)
        # Host buffers the launched decode steps' tokens are copied into (launch_decode).
        self._pinned_out: list[torch.Tensor] | None = None
        self._pinned_flip = 0
        # Draws the noise of the decode graphs' sampling; a graph-safe generator of its own,
        # apart from the one the engine samples with eagerly.
        self.graph_generator = torch.Generator(device=self.device)
        self.graph_generator.seed()
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        # Graphs replay one at a time on the engine thread and their logits are copied out
        # before the next replay, so all of them can share one memory pool.
        self._graph_pool: Any = None  # torch.cuda.graph_pool_handle()
        self.graph_error: str | None = None
        self._graph_buckets: list[int] = []
        self._kv_buckets = kv_len_buckets(max_len)
        if use_graphs:
            self._graph_buckets = _buckets(num_slots)
            # Every graph now, before a trainer shares the device: a capture is invalidated
            # by CUDA work that another thread does while it runs, and lazily capturing a
            # new bucket mid-run would race the training step.
            self.capture_graphs()

    @property
    def graphs_enabled(self) -> bool:
        """Whether decode steps replay CUDA graphs (until a capture fails)."""
        return bool(self._graph_buckets)

    @property
    def graph_count(self) -> int:
        """Decode graphs captured so far."""
        return len(self._graphs)

    @staticmethod
    def _set_attention(model: torch.nn.Module) -> None:
        try:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        except (AttributeError, ValueError):
            # Older transformers: the config attribute is what every attention layer reads.
            model.config._attn_implementation = ATTN_IMPLEMENTATION

    def load_weights(self, source: WeightSource) -> list[str]:
        """Write new weights from ``source`` (see ``weights.load_into``) into the model and
        the copies the forward reads; returns the model's names of the tensors written."""
        written = load_into(self.model, source, writers=self.sole_copies.writers)
        self.sole_copies.flush()
        self.weights_changed(written)
        return written

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters by name (tied ones once), with the values of those whose
        sole copy the runner holds: what ``load_weights`` would write back unchanged."""
        return {
            name: held if (held := self.sole_copies.weight(name)) is not None else p.detach()
            for name, p in self.model.named_parameters()
        }

    def weights_changed(self, names: list[str]) -> None:
        """The model's tensors ``names`` were overwritten (a weight update)."""
        if self.packed_linears is not None:
            self.packed_linears.repack(names)
        if self.fused is not None:
            self.fused.weights_changed(names)

    def release_model(self) -> None:
        """Give the model's layers back their weights and plain forward (the runner is done
        with it)."""
        self.sole_copies.restore()
        if self.packed_linears is not None:
            self.packed_linears.remove()
            self.packed_linears = None
        self.fused = None

    # -- forward passes ---------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, rows: list[RowInput], logits_at: list[int] | None = None) -> torch.Tensor:
        """Feed ``rows``; return ``[len(rows), vocab]`` logits at each row's last real token,
        or at the flat positions ``logits_at`` (row * width + column) when given."""
        width = max(len(r.tokens) for r in rows)
        if width == 1 and logits_at is None:
            return self.decode(
                [r.slot for r in rows], [r.start for r in rows], [r.tokens[0] for r in rows]
            )
        if self.packed_prefill and logits_at is None:
            return self._forward_packed(rows)
        n = len(rows)
        scratch = self.cache.scratch
        ids = torch.zeros((n, width), dtype=torch.long)
        pos = torch.zeros((n, width), dtype=torch.long)
        write = torch.full((n, width), scratch, dtype=torch.long)
        qpos = torch.zeros((n, width), dtype=torch.long)
        last = []
        for i, r in enumerate(rows):
            t = len(r.tokens)
            ids[i, :t] = torch.tensor(r.tokens)
            span = torch.arange(r.start, r.start + t)
            pos[i, :t] = span
            pos[i, t:] = r.start + t - 1
            write[i, :t] = span
            qpos[i, :t] = span
            qpos[i, t:] = r.start + t - 1
            last.append(i * width + t - 1)
        kv_len = int(qpos.max()) + 1
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        dev = self.device
        mask = self._positions[:kv_len].view(1, 1, 1, kv_len) <= qpos.to(dev).view(n, 1, width, 1)
        step = StepContext(
            cache=self.cache,
            slots=slots.to(dev),
            slot_index=slots.view(n, 1).expand(n, width).to(dev),
            write_pos=write.to(dev),
            mask=mask,
            kv_len=kv_len,
            rows_are_slots=False,
        )
        hidden = self._hidden(ids.to(dev), pos.to(dev), step)
        flat = hidden.reshape(n * width, -1)
        index = torch.tensor(logits_at if logits_at is not None else last, device=dev)
        return self._lm_head(flat.index_select(0, index)).float()

    def _forward_packed(self, rows: list[RowInput]) -> torch.Tensor:
        """``forward`` with every row's tokens in one packed row (see ``PackedRows``)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        key_slots: list[int] = []
        key_pos: list[int] = []
        cu_q, cu_k = [0], [0]
        for r in rows:
            t = len(r.tokens)
            end = r.start + t
            ids += r.tokens
            pos += range(r.start, end)
            slots += [r.slot] * t
            key_slots += [r.slot] * end
            key_pos += range(end)
            cu_q.append(cu_q[-1] + t)
            cu_k.append(cu_k[-1] + end)
        n = len(ids)
        dev = self.device
        k, s = len(key_pos), len(cu_q)
        # One host->device copy of everything, sliced on the device.
        flat = to_device(ids + pos + slots + key_slots + key_pos + cu_q + cu_k, torch.long, dev)
        ids_t, pos_t, slots_t = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        k_slots, k_pos = flat[3 * n : 3 * n + k], flat[3 * n + k : 3 * n + 2 * k]
        bounds = flat[3 * n + 2 * k :].to(torch.int32)
        packed = PackedRows(
            cu_q=bounds[:s],
            cu_k=bounds[s:],
            max_q=max(len(r.tokens) for r in rows),
            max_k=max(r.start + len(r.tokens) for r in rows),
            key_slots=k_slots,
            key_pos=k_pos,
            starts=[r.start for r in rows],
            flash=self._flash,
        )
        step = StepContext(
            cache=self.cache,
            slots=slots_t,
            slot_index=slots_t.view(1, n),
            write_pos=pos_t.view(1, n),
            # A 4D mask stops transformers from building one; packed attention reads none.
            mask=self._no_mask,
            kv_len=0,
            rows_are_slots=False,
            packed=packed,
        )
        hidden = self._hidden(ids_t.view(1, n), pos_t.view(1, n), step)[0]
        return self._lm_head(hidden.index_select(0, packed.cu_q[1:].long() - 1)).float()

    @torch.inference_mode()
    def decode(self, slots: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each of ``slots``; returns ``[len(slots), vocab]`` logits."""
        width, graph, kv_needed = self._decode_shape(slots, positions)
        ids, pos, write = self._decode_rows(width, slots, positions, tokens)
        select = slots + [0] * (width - len(slots))
        # One copy for the step's inputs and the rows to return.
        packed = to_device([ids, pos, write, select], torch.long, self.device)
        if graph is not None:
            logits = graph.run(packed[:3])
        else:
            logits = self._decode_eager(packed[0], packed[1], packed[2], kv_len=kv_needed)
        return logits.index_select(0, packed[3, : len(slots)]).float()

    @torch.inference_mode()
    def decode_sampled(
        self, slots: list[int], positions: list[int], tokens: list[int], temperatures: list[float]
    ) -> tuple[list[int], list[float]] | None:
        """One decode step that also samples, inside the step's CUDA graph: each of ``slots``
        draws a token at its temperature (0: greedy) as ``sample_temperature`` does. Returns
        the tokens and their logprobs, or None when no sampling graph covers the step (the
        caller then samples ``decode``'s logits).

        The whole step is one input copy, one replay and one output copy. That matters
        beside a trainer in the same process: every torch call releases and retakes the GIL,
        and each retake can wait a switch interval for the trainer's thread."""
        launch = self._graph_launch(slots, positions, tokens, temperatures)
        return None if launch is None else launch.result()

    @torch.inference_mode()
    def launch_decode(
        self, slots: list[int], positions: list[int], tokens: list[int], temperatures: list[float]
    ) -> DecodeLaunch | None:
        """``decode_sampled`` without waiting for it: the step is queued on the device and
        its tokens come from ``DecodeLaunch.result()``. Where no sampling graph covers the
        step it runs eagerly, and the launch holds its tokens already."""
        launch = self._graph_launch(slots, positions, tokens, temperatures)
        if launch is None:
            return self._eager_launch(slots, positions, tokens, temperatures)
        return launch

    def _graph_launch(
        self, slots: list[int], positions: list[int], tokens: list[int], temperatures: list[float]
    ) -> DecodeLaunch | None:
        """One input copy and one replay of the sampling graph covering the step, if any."""
        width, graph, _ = self._decode_shape(slots, positions)
        if graph is None or graph.sampled is None:
            return None
        ids, pos, write = self._decode_rows(width, slots, positions, tokens)
        temperature = [1.0] * width
        for slot, t in zip(slots, temperatures, strict=True):
            temperature[slot] = t
        graph.inputs.copy_(to_device([ids, pos, write, temperature], torch.float64, self.device))
        return self._replay(graph, slots, positions)

    @torch.inference_mode()
    def continue_decode(self, previous: DecodeLaunch, slots: list[int]) -> DecodeLaunch | None:
        """The next decode step of ``slots`` (rows of ``previous``), fed on the device from the
        tokens ``previous`` samples: queued before the host has read them, so the host's
        bookkeeping of one step overlaps the device's next. Rows of ``previous`` left out
        (finished requests) write to the scratch column. None where no graph covers it."""
        at = dict(zip(previous.slots, previous.positions, strict=True))
        positions = [at[slot] + 1 for slot in slots]
        source = previous.graph
        if source is None:  # an eager launch: its tokens are on the host already
            tokens, _ = previous.result()
            sampled = dict(zip(previous.slots, tokens, strict=True))
            assert previous.temperature_of is not None
            temperatures = [previous.temperature_of[s] for s in slots]
            return self._eager_launch(slots, positions, [sampled[s] for s in slots], temperatures)
        kv_needed = max(positions) + 1
        kv_len = next((b for b in self._kv_buckets if b >= kv_needed), None)
        graph = None if kv_len is None else self._graph(previous.width, kv_len)
        if graph is None or graph.sampled is None:
            return None
        live = torch.zeros(previous.width, dtype=torch.bool)
        live[slots] = True
        live = _pinned(live, self.device.type == "cuda").to(self.device, non_blocking=True)
        scratch = float(self.cache.scratch)
        graph.inputs[0].copy_(source.sampled[0])
        graph.inputs[1].copy_(source.inputs[1] + live)
        graph.inputs[2].copy_(torch.where(live, source.inputs[2] + 1, scratch))
        if graph is not source:
            graph.inputs[3].copy_(source.inputs[3])
        return self._replay(graph, slots, positions)

    def _eager_launch(
        self, slots: list[int], positions: list[int], tokens: list[int], temperatures: list[float]
    ) -> DecodeLaunch:
        logits = self.decode(slots, positions, tokens)
        temperature = torch.tensor(temperatures, dtype=torch.float32, device=self.device)
        ids, logprobs = sample_temperature(logits, temperature, self.graph_generator)
        # Indexed by slot, as a graph's output of that width.
        width = max(slots) + 1
        host = torch.zeros(2, width, dtype=torch.float64)
        host[:, slots] = torch.stack([ids.double(), logprobs.double()]).cpu()
        temperature_of = dict(zip(slots, temperatures, strict=True))
        return DecodeLaunch(slots, positions, None, width, host, None, temperature_of)

    def _replay(self, graph: _DecodeGraph, slots: list[int], positions: list[int]) -> DecodeLaunch:
        graph.graph.replay()
        cuda = self.device.type == "cuda"
        # Two pinned buffers in turn: a step's tokens land in one while the host reads the
        # previous step's from the other.
        if self._pinned_out is None:
            self._pinned_out = [
                _pinned(torch.empty(2, self.num_slots, dtype=torch.float64), cuda) for _ in range(2)
            ]
        self._pinned_flip ^= 1
        host = self._pinned_out[self._pinned_flip][:, : graph.width]
        host.copy_(graph.sampled, non_blocking=True)
        done = torch.cuda.Event() if cuda else None
        if done is not None:
            done.record()
        return DecodeLaunch(slots, positions, graph, graph.width, host, done)

    def _decode_shape(
        self, slots: list[int], positions: list[int]
    ) -> tuple[int, _DecodeGraph | None, int]:
        """The step's width (rows are slots 0..width-1), its graph if one covers it, and the
        cache length it attends over."""
        rows = max(slots) + 1
        bucket = next((b for b in self._graph_buckets if b >= rows), None)
        kv_needed = max(positions) + 1
        if bucket is None:
            return rows, None, kv_needed
        graph = self._graph(bucket, next(b for b in self._kv_buckets if b >= kv_needed))
        return (bucket if graph is not None else rows), graph, kv_needed

    def _decode_rows(
        self, width: int, slots: list[int], positions: list[int], tokens: list[int]
    ) -> tuple[list[int], list[int], list[int]]:
        # Idle rows write to the scratch column and look at position 0 of their own slot
        # (finite, ignored).
        ids = [0] * width
        pos = [0] * width
        write = [self.cache.scratch] * width
        for slot, position, token in zip(slots, positions, tokens, strict=True):
            ids[slot] = token
            pos[slot] = position
            write[slot] = position
        return ids, pos, write

    def _decode_eager(
        self, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, *, kv_len: int
    ) -> torch.Tensor:
        dev = self.device
        width = ids.shape[0]
        pos = pos.to(dev, non_blocking=True)
        mask = self._positions[:kv_len].view(1, 1, 1, kv_len) <= pos.view(width, 1, 1, 1)
        step = StepContext(
            cache=self.cache,
            slots=self._slot_ids[:width],
            slot_index=self._slot_ids[:width].view(width, 1),
            write_pos=write.to(dev, non_blocking=True).view(width, 1),
            mask=mask,
            kv_len=kv_len,
            rows_are_slots=True,
            lengths=pos + 1 if self._cpu_kernels or self.flash_decode else None,
            flash_decode=self.flash_decode,
        )
        hidden = self._hidden(
            ids.to(dev, non_blocking=True).view(width, 1), pos.view(width, 1), step
        )
        return self._lm_head(hidden[:, -1])

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor, step: StepContext) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.hidden(ids, pos, step)
        # A 4D attention_mask makes transformers skip its own mask construction (no host
        # syncs, so decode can be captured in a CUDA graph); the attention reads step.mask.
        out = self._backbone(
            input_ids=ids,
            position_ids=pos,
            attention_mask=step.mask,
            use_cache=False,
            areal_step=step,
        )
        return out.last_hidden_state

    def _graph(self, rows: int, kv_len: int) -> _DecodeGraph | None:
        graph = self._graphs.get((rows, kv_len))
        if graph is None:
            try:
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                graph = _DecodeGraph(self, rows, kv_len, self._graph_pool)
                self._graphs[rows, kv_len] = graph
            except Exception as exc:  # a model whose forward cannot be captured runs eagerly
                log.warning("CUDA graph capture failed (%r); decoding eagerly", exc, exc_info=True)
                self.graph_error = repr(exc)
                self._graph_buckets = []
                self._graphs.clear()
                return None
        return graph

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture the decode graph of every batch-size and cache-length bucket (the runner
        does it when built; after ``drop_graphs`` first use does it lazily); returns how
        many are captured. A no-op without CUDA graphs."""
        for bucket in list(self._graph_buckets):
            for kv_len in self._kv_buckets:
                if self._graph(bucket, kv_len) is None:
                    return 0  # capture failed: the runner decodes eagerly from now on
        return len(self._graphs)

    def drop_graphs(self) -> None:
        """Forget captured graphs. Weight updates copy in place, so they never need this."""
        self._graphs.clear()


def _pinned(tensor: torch.Tensor, cuda: bool) -> torch.Tensor:
    """``tensor`` in page-locked memory where a CUDA copy reads or writes it asynchronously."""
    return tensor.pin_memory() if cuda else tensor


def kv_len_buckets(max_len: int) -> list[int]:
    """Cache lengths a decode graph attends over: powers of two from 128, then the whole
    cache (``max_len`` + 1, the scratch column included). A step uses the smallest that
    covers its longest sequence, so it reads at most twice the cache it needs."""
    full = max_len + 1
    out, size = [], 128
    while size < full:
        out.append(size)
        size *= 2
    return [*out, full]


def _buckets(num_slots: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    sizes += list(range(320, num_slots + 64, 64))
    out = sorted({min(s, num_slots) for s in sizes})
    return out


@dataclass
class DecodeLaunch:
    """A decode step queued on the device: its rows' slots and positions, and where its
    sampled tokens and logprobs arrive (``result()`` waits for them)."""

    slots: list[int]
    positions: list[int]
    graph: _DecodeGraph | None  # None: run eagerly, ``host`` holds the tokens already
    width: int
    host: torch.Tensor  # [2, width] float64 by slot: ids, logprobs (pinned for a graph's)
    done: torch.cuda.Event | None
    # An eager launch's temperatures by slot (a graph's stay in its inputs on the device).
    temperature_of: dict[int, float] | None = None

    def result(self) -> tuple[list[int], list[float]]:
        """The tokens and logprobs of ``slots``, in order (waits for the step)."""
        if self.done is not None:
            self.done.synchronize()
        ids, logprobs = self.host.tolist()
        return [int(ids[s]) for s in self.slots], [logprobs[s] for s in self.slots]


class _DecodeGraph:
    """A CUDA graph of one decode step for ``width`` rows, attending over the first
    ``kv_len`` positions of each row's cache. It leaves the step's logits in ``logits`` and,
    where the device's torch can capture the runner's generator, the tokens sampled from them
    at each row's temperature in ``sampled`` (``[2, width]`` float64: ids, logprobs)."""

    def __init__(self, runner: ModelRunner, width: int, kv_len: int, pool: Any) -> None:
        dev = runner.device
        self.runner = runner
        self.width = width
        # The graph's static inputs, one row each: ids, positions, cache write positions
        # (integers, exact in float64) and temperatures.
        self.inputs = torch.zeros(4, width, dtype=torch.float64, device=dev)
        self.inputs[2].fill_(runner.cache.scratch)
        self.inputs[3].fill_(1.0)
        self.graph = torch.cuda.CUDAGraph()
        # A generator used inside a graph must be registered with it, so that each replay
        # draws fresh numbers; on a torch without that call the graph only computes logits.
        samples = hasattr(self.graph, "register_generator_state")
        if samples:
            self.graph.register_generator_state(runner.graph_generator)

        def step() -> tuple[torch.Tensor, torch.Tensor | None]:
            ids, pos, write = self.inputs[:3].long().unbind(0)
            logits = runner._decode_eager(ids, pos, write, kv_len=kv_len)
            if not samples:
                return logits, None
            tokens, logprobs = sample_temperature(
                logits, self.inputs[3].float(), runner.graph_generator
            )
            return logits, torch.stack([tokens.double(), logprobs.double()])

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels and allocator pools outside the graph
                step()
        torch.cuda.current_stream().wait_stream(stream)
        # thread_local: CUDA calls of other threads (a trainer on the same device) do not
        # invalidate this capture; only this thread's own unsafe calls would.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.logits, self.sampled = step()
        log.info("captured a decode CUDA graph for %d rows over %d positions", width, kv_len)

    def run(self, inputs: torch.Tensor) -> torch.Tensor:
        """Replay on ``inputs`` (``[3, width]``: ids, positions, write positions); return
        the logits."""
        self.inputs[:3].copy_(inputs, non_blocking=True)
        self.graph.replay()
        return self.logits
