"""Low-rank gradient compression (docs/algorithms.md §5): ``powersgd`` and ``acpsgd``.

Each parameter of a bucket whose gradient has ≥ 2 dims is viewed as a matrix ``M`` of shape
``[out, rest]`` (a conv weight ``[o, i, kh, kw]`` as ``[o, i·kh·kw]``) with rank ``r' = min(r, out,
rest)``; it is compressed when ``(out + rest)·r'·min_compression_rate < out·rest``. Everything else in
the bucket (vectors, small matrices) is averaged densely in the same allreduce as the first factor.
The factors of all compressible matrices of a bucket travel in one flat buffer, so one allreduce per
factor per bucket; same-shape matrices are batched (``bmm``). Factors are fp32 whatever the
gradient dtype. State (error, factors) is per parameter and checkpointed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import kernels
from ..bucket import Bucket, all_finite, assign_if_finite, to_device
from ..communicators import Communicator, Exchange
from ..registry import Option
from .base import COMPRESSORS, Compressor, LocalForm, local_in_form
from .factors import normalize_columns, orthogonalize, product
from .memory import compensated_from, keep_difference

LOWRANK_OPTIONS = {
    "rank": Option(4, int, low=1, help="r"),
    "start_iter": Option(10, int, low=0, help="steps of plain allreduce before compressing"),
    "min_compression_rate": Option(2.0, float, low=0.0, low_open=True),
    "use_error_feedback": Option(True, bool),
    "orthogonalization_epsilon": Option(0.0, float, low=0.0),
    "seed": Option(0, int, low=0, help="seed of the initial factors, shared by all ranks"),
}


@dataclass
class _Matrix:
    name: str
    offset: int
    rows: int
    cols: int
    rank: int


@dataclass
class _Layout:
    """Which parts of a bucket are compressed, grouped by shape for batching.

    The factors of all compressed matrices are held as two zero-padded batches, ``P`` as
    ``[matrices, largest rows, r]`` and ``Q`` as ``[matrices, largest cols, r]``, the matrices of
    shape ``k`` at positions ``slots[k]``: one orthogonalisation covers them all. ``index[kind]``
    lists, in payload order (shape by shape, each factor row-major), the positions of the real
    factor entries in the flattened padded batch.
    """

    by_shape: dict[tuple, list[_Matrix]]
    dense: Tensor  # int64 positions of the densely averaged elements
    slots: list[slice]
    sizes: dict[str, int]  # kind -> padded size
    index: dict[str, Tensor]
    runs: list[list[tuple[int, int]]]  # per shape, its spans of evenly spaced matrices (:meth:`_LowRank._runs`)
    padded: dict[str, Tensor] = field(default_factory=dict)  # kind -> the batch :meth:`_LowRank._padded` fills

    @property
    def matrices(self) -> list[_Matrix]:
        return [m for ms in self.by_shape.values() for m in ms]

    def views(self, kind: str, batch: Tensor) -> list[Tensor]:
        """Per shape, its factors ``[b, rows or cols, rank]`` as views of the padded ``batch``."""
        views = []
        for ms, slot in zip(self.by_shape.values(), self.slots):
            size = ms[0].rows if kind == "p" else ms[0].cols
            views.append(batch[slot, :size, : ms[0].rank])
        return views


class _LowRank(Compressor):
    summable = True
    allreduce_only = True
    works_on_matrices = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.keeps_error_feedback = options["use_error_feedback"]
        self._batches: dict[tuple[str, tuple[str, ...]], Tensor] = {}  # (kind, bucket names) -> padded factors
        self._restored: dict[str, dict[str, Tensor]] = {"p": {}, "q": {}}  # from a checkpoint, by parameter
        self._layouts: dict[tuple[str, ...], _Layout] = {}

    # ---------------------------------------------------------------- layout
    @staticmethod
    def batch_by_shape(device: torch.device) -> bool:
        """Batch same-shape matrices into one ``bmm`` on a GPU (fewer kernel launches); one matrix
        per batch on the CPU, where a batch of several costs a copy of each matrix in and out."""
        return not kernels.in_host_memory(device)

    def layout(self, bucket: Bucket) -> _Layout:
        key = tuple(bucket.names)
        if key not in self._layouts:
            by_shape: dict[tuple, list[_Matrix]] = {}
            dense_mask = torch.ones(bucket.numel, dtype=torch.bool)
            for name, shape, offset, numel in zip(bucket.names, bucket.shapes, bucket.offsets, bucket.numels):
                if len(shape) < 2:
                    continue
                rows, cols = shape[0], numel // shape[0]
                rank = min(self.options["rank"], rows, cols)
                if (rows + cols) * rank * self.options["min_compression_rate"] < rows * cols:
                    shape_key = (rows, cols, rank) if self.batch_by_shape(bucket.device) else (rows, cols, rank, name)
                    by_shape.setdefault(shape_key, []).append(_Matrix(name, offset, rows, cols, rank))
                    dense_mask[offset : offset + numel] = False
            dense = to_device(torch.nonzero(dense_mask).view(-1), bucket.device)
            slots, start = [], 0
            for ms in by_shape.values():
                slots.append(slice(start, start + len(ms)))
                start += len(ms)
            sizes = {
                "p": max((m.rows for ms in by_shape.values() for m in ms), default=0),
                "q": max((m.cols for ms in by_shape.values() for m in ms), default=0),
            }
            runs = [self._runs(ms) for ms in by_shape.values()]
            layout = _Layout(by_shape, dense, slots, sizes, {}, runs)
            for kind, size in sizes.items():
                positions = torch.arange(start * size * self.options["rank"]).view(start, size, self.options["rank"])
                pieces = [view.reshape(-1) for view in layout.views(kind, positions)] or [positions.view(-1)]
                layout.index[kind] = to_device(torch.cat(pieces), bucket.device)
            self._layouts[key] = layout
        return self._layouts[key]

    # ---------------------------------------------------------------- factors
    def initial_factor(self, kind: str, name: str, rows: int, rank: int) -> Tensor:
        """A Gaussian ``[rows, rank]`` factor seeded by (seed, factor, parameter name) and, without
        ``warm_start``, the step: the same on every rank and in every process, and without warm start
        a fresh draw every step, as in the paper and torch's ``powerSGD_hook``."""
        step = -1 if self._warm_start() else self.step
        mixed = (self.options["seed"] * 1_000_003 + zlib.crc32(f"{kind}:{name}".encode())) * 1_000_033 + step + 1
        return torch.randn(rows, rank, generator=torch.Generator().manual_seed(mixed % (2**63 - 1)))

    def _initial(self, kind: str, m: _Matrix) -> Tensor:
        return self.initial_factor(kind, m.name, m.rows if kind == "p" else m.cols, m.rank)

    def factor_batch(self, kind: str, bucket: Bucket, device: torch.device) -> Tensor:
        """This bucket's stored factors as one zero-padded batch (see :class:`_Layout`): last step's
        (``warm_start``), a checkpoint's, or initial ones from the seed all ranks share (every step
        anew without ``warm_start``). A batch built for new buckets (a changed fusion plan) takes over
        the factors of the old ones by name."""
        key = (kind, tuple(bucket.names))
        warm = self._warm_start()
        if warm and key in self._batches:
            return self._batches[key]
        layout = self.layout(bucket)
        known = {**self.factors_by_parameter(kind), **self._restored[kind]} if warm else {}
        batch = torch.zeros(len(layout.matrices), layout.sizes[kind], self.options["rank"])
        for slot, m in enumerate(layout.matrices):
            value = known.get(m.name)
            value = self._initial(kind, m) if value is None else value
            batch[slot, : value.shape[0], : m.rank] = value
            self._restored[kind].pop(m.name, None)
        if not warm:
            return to_device(batch, device)
        names = set(bucket.names)
        for old in [k for k in self._batches if k[0] == kind and names & set(k[1])]:
            del self._batches[old]
        self._batches[key] = to_device(batch, device)
        return self._batches[key]

    def _warm_start(self) -> bool:
        """Whether last step's factors start this step's power iteration (PowerSGD's option)."""
        return True

    def keep_factors(self, kind: str, bucket: Bucket, batch: Tensor, finite: Tensor) -> None:
        """Store the factors for the next step (not from a bucket holding inf/NaN; without
        ``warm_start`` every step draws fresh ones)."""
        if not self._warm_start():
            return
        stored = self.factor_batch(kind, bucket, batch.device)
        assign_if_finite(stored, batch, finite)

    def factors_by_parameter(self, kind: str) -> dict[str, Tensor]:
        """The stored factors ``[rows or cols, rank]`` by parameter name."""
        out = {}
        for (k, names), batch in self._batches.items():
            if k == kind:
                layout = self._layouts[names]
                for slot, m in enumerate(layout.matrices):
                    out[m.name] = batch[slot, : m.rows if kind == "p" else m.cols, : m.rank]
        return out

    # ---------------------------------------------------------------- shared pieces
    def _compressed_input(self, flat: Tensor, bucket: Bucket) -> tuple[_Layout, Tensor, Tensor, list] | None:
        """The bucket's layout, its finite flag, the compensated input ``M`` and its matrices by
        shape; None before ``start_iter`` or for a bucket without matrices (sent dense instead)."""
        layout = self.layout(bucket)
        if self.step < self.options["start_iter"] or not layout.by_shape:
            return None
        finite = all_finite(flat)
        m_flat = self._compensated(flat, bucket, finite)
        mats = [self._matrices(m_flat, ms, runs) for ms, runs in zip(layout.by_shape.values(), layout.runs)]
        return layout, finite, m_flat, mats

    def _compensated(self, flat: Tensor, bucket: Bucket, finite: Tensor) -> Tensor:
        """``M = g + e``, formed in ``e`` itself where that is safe (see
        :func:`~gc_strategy.algos.memory.compensated_from`)."""
        if not self.options["use_error_feedback"]:
            return flat.float()
        error, into = self.rewritten("error", bucket)
        return compensated_from(error, flat, finite, into=into)

    @staticmethod
    def _runs(matrices: list[_Matrix]) -> list[tuple[int, int]]:
        """``[i, j)`` spans of same-shape matrices lying at evenly spaced offsets (repeated blocks
        of a network: layer ``k`` of each block a block's stride apart), longest first from the left."""
        size, runs, start = matrices[0].rows * matrices[0].cols, [], 0
        while start < len(matrices):
            end = start + 1
            if end < len(matrices):
                step = matrices[end].offset - matrices[start].offset
                while step >= size and end < len(matrices) and matrices[end].offset - matrices[end - 1].offset == step:
                    end += 1
            runs.append((start, end))
            start = end
        return runs

    @staticmethod
    def _batch_view(flat: Tensor, matrices: list[_Matrix]) -> Tensor:
        """Evenly spaced same-shape matrices (a span of :meth:`_runs`) as one ``[b, rows, cols]``
        view of ``flat``."""
        first = matrices[0]
        step = matrices[1].offset - first.offset if len(matrices) > 1 else first.rows * first.cols
        shape, strides = (len(matrices), first.rows, first.cols), (step, first.cols, 1)
        return flat.as_strided(shape, strides, flat.storage_offset() + first.offset)

    @classmethod
    def _matrices(cls, m_flat: Tensor, matrices: list[_Matrix], runs: list[tuple[int, int]]) -> Tensor:
        """The batch ``[b, rows, cols]`` of same-shape matrices: a view of ``m_flat`` where they are
        evenly spaced (one of ``runs``), a stacked copy of the spans otherwise."""
        views = [cls._batch_view(m_flat, matrices[i:j]) for i, j in runs]
        return views[0] if len(views) == 1 else torch.cat(views)

    @classmethod
    def _write_products(cls, out: Tensor, layout: _Layout, p: Tensor, q: Tensor) -> None:
        """``P Qᵀ`` of every matrix (padded factor batches ``p``, ``q``) into its place in the flat
        ``out``: one ``bmm`` into a view of ``out`` per span of evenly spaced matrices."""
        batches = zip(layout.by_shape.values(), layout.runs, layout.views("p", p), layout.views("q", q))
        for matrices, runs, p_batch, q_batch in batches:
            for i, j in runs:
                torch.bmm(p_batch[i:j], q_batch[i:j].transpose(1, 2), out=cls._batch_view(out, matrices[i:j]))

    @staticmethod
    def _products(kind: str, mats: list[Tensor], layout: _Layout, other: Tensor) -> Tensor:
        """The factors of ``kind`` from the other, padded ones, in payload order: ``P = M Q`` or
        ``Q = Mᵀ P`` for every shape (:func:`product`)."""
        side = "q" if kind == "p" else "p"
        return torch.cat([product(kind, m, f).reshape(-1) for m, f in zip(mats, layout.views(side, other))])

    def _padded(self, kind: str, layout: _Layout, flat: Tensor) -> Tensor:
        """Factors in payload order -> the zero-padded batch (see :class:`_Layout`), kept per
        bucket and kind: only the real entries are written, so its padding stays zero (as does
        every product and orthogonalisation of it). Valid until the next call for the bucket."""
        batch = layout.padded.get(kind)
        if batch is None or batch.device != flat.device or batch.dtype != flat.dtype:
            batch = layout.padded[kind] = flat.new_zeros(len(layout.matrices), layout.sizes[kind], self.options["rank"])
        batch.view(-1).index_copy_(0, layout.index[kind], flat)
        return batch

    def _keep_error(self, m_flat: Tensor, approximation: Tensor, bucket: Bucket, finite: Tensor) -> None:
        """``e = M - approximation`` on the compressed matrices (dense parts are exact: no error).
        After it, ``M`` may no longer be read: it may have been ``e`` itself."""
        if not self.options["use_error_feedback"]:
            return
        error = self.buffer("error", bucket)
        keep_difference(error, m_flat, approximation, finite)
        error.index_fill_(0, self.layout(bucket).dense, 0)

    def _dense_exchange(self, flat: Tensor, communicator: Communicator, local_form: LocalForm) -> Exchange:
        """Plain allreduce of the whole bucket (before ``start_iter``, or nothing to compress)."""
        local = flat.float()
        (summed,) = yield from communicator.exchange([local.clone()], False)
        return summed.div_(communicator.world_size), local_in_form(local, local_form)

    def extra_state(self) -> dict[str, Any]:
        return {
            "factors": {
                kind: {**self._restored[kind], **{n: t.clone() for n, t in self.factors_by_parameter(kind).items()}}
                for kind in ("p", "q")
            }
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Factors by parameter name (e.g. a checkpoint's); each bucket's batch takes them up."""
        factors = state.get("factors", {})
        self._restored = {kind: dict(factors.get(kind, {})) for kind in ("p", "q")}
        self._batches = {}


def _result_buffer(m_flat: Tensor, out: Tensor | None) -> Tensor:
    """Where a low-rank exchange writes its average: ``out`` (the gradient buffer) when given in M's
    dtype, else a new tensor. M itself is no longer read once the average is being written, except
    for its error, and where it carries an error it is not the gradient buffer (it is ``e`` itself,
    or a new ``g + e``)."""
    return out if out is not None and out.dtype == m_flat.dtype else torch.empty_like(m_flat)


@COMPRESSORS.register("powersgd")
class PowerSGD(_LowRank):
    """PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019), one power iteration per step, for all
    compressible matrices of a bucket at once:

    1. ``M ← M + e`` (``use_error_feedback``);
    2. ``Q``: last step's (``warm_start``) or a Gaussian from a seed all ranks share; its columns
       normalised;
    3. ``P = M Q``; allreduce-sum all P (and the dense part) in one buffer; orthogonalise each P;
    4. ``Q = Mᵀ P``; allreduce-sum all Q in one buffer; ``Q ← Q / W``;
    5. ``ĝ = P Qᵀ``; ``e = M - ĝ`` (local input minus the global approximation).

    torch's ``powerSGD_hook`` orthogonalises Q in step 2. The result ``P Pᵀ M̄`` does not depend on
    it in exact arithmetic (:func:`~gc_strategy.algos.factors.normalize_columns`), and normalised
    columns keep the iteration as well conditioned, in 3 launches a bucket instead of ``7r − 4``.
    Unlike the hook, the densely averaged tensors carry no error feedback: their average is exact.
    """

    OPTIONS = {**LOWRANK_OPTIONS, "warm_start": Option(True, bool)}

    def _warm_start(self) -> bool:
        return self.options["warm_start"]

    def exchange(
        self, flat: Tensor, bucket: Bucket, communicator: Communicator, local_form: LocalForm, out: Tensor | None = None
    ) -> Exchange:
        started = self._compressed_input(flat, bucket)
        if started is None:
            return (yield from self._dense_exchange(flat, communicator, local_form))
        layout, finite, m_flat, mats = started
        eps = self.options["orthogonalization_epsilon"]
        q = normalize_columns(self.factor_batch("q", bucket, flat.device), eps)
        p_flat = self._products("p", mats, layout, q)
        # eager: the synchroniser advances it during backward (a later bucket's launch), so Q goes out early
        (summed,) = yield from communicator.exchange([torch.cat([p_flat, m_flat[layout.dense]])], False, eager=True)
        p = orthogonalize(self._padded("p", layout, summed[: p_flat.numel()]), eps)
        (summed_q,) = yield from communicator.exchange([self._products("q", mats, layout, p)], False)
        q = self._padded("q", layout, summed_q.div_(communicator.world_size))
        result = _result_buffer(m_flat, out)  # every element is written: the dense part, then each matrix
        result[layout.dense] = summed[p_flat.numel() :] / communicator.world_size
        self._write_products(result, layout, p, q)
        self.keep_factors("q", bucket, q, finite)
        self._keep_error(m_flat, result, bucket, finite)
        return result, local_in_form(result, local_form)


@COMPRESSORS.register("acpsgd")
class ACPSGD(_LowRank):
    """ACP-SGD (Zhang, Zhang, Shi, Chu & Li, ICDCS 2023, "Evaluation and Optimization of Gradient
    Compression for Distributed Deep Learning"): PowerSGD's two factors, sent on alternate steps, so
    one allreduce per bucket per step that pipelines and fuses like a plain allreduce.

    - P step (odd compressed step): ``Q ← orth(Q_prev)``, ``P = M Q``, ``e = M - P Qᵀ``, allreduce P,
      ``ĝ = P_sum Qᵀ / W``;
    - Q step (even): ``P ← orth(P_prev)``, ``Q = Mᵀ P``, ``e = M - P Qᵀ``, allreduce Q,
      ``ĝ = P Q_sumᵀ / W``;

    with ``M`` the error-compensated gradient. The factor not sent is the previous step's
    aggregated one, identical on every rank; the initial factors come from a seed all ranks share
    (the public code left them unseeded, so the first step differed between ranks).
    """

    OPTIONS = dict(LOWRANK_OPTIONS)
    per_step_schedule = True

    def is_p_step(self) -> bool:
        return (self.step - self.options["start_iter"]) % 2 == 0

    def exchange(
        self, flat: Tensor, bucket: Bucket, communicator: Communicator, local_form: LocalForm, out: Tensor | None = None
    ) -> Exchange:
        started = self._compressed_input(flat, bucket)
        if started is None:
            return (yield from self._dense_exchange(flat, communicator, local_form))
        layout, finite, m_flat, mats = started
        eps = self.options["orthogonalization_epsilon"]
        sent, fixed = ("p", "q") if self.is_p_step() else ("q", "p")
        fixed_batch = orthogonalize(self.factor_batch(fixed, bucket, flat.device).clone(), eps)
        sent_flat = self._products(sent, mats, layout, fixed_batch)
        local = torch.empty_like(m_flat)  # every element is written: the dense part, then each matrix
        local[layout.dense] = m_flat[layout.dense]
        self._write_products(local, layout, *self._ordered(sent, self._padded(sent, layout, sent_flat), fixed_batch))
        payload = torch.cat([sent_flat, m_flat[layout.dense]])
        self._keep_error(m_flat, local, bucket, finite)
        (summed,) = yield from communicator.exchange([payload], False)
        summed.div_(communicator.world_size)
        averaged = self._padded(sent, layout, summed[: sent_flat.numel()])
        result = _result_buffer(m_flat, out)
        result[layout.dense] = summed[sent_flat.numel() :]
        self._write_products(result, layout, *self._ordered(sent, averaged, fixed_batch))
        self.keep_factors(sent, bucket, averaged, finite)
        self.keep_factors(fixed, bucket, fixed_batch, finite)
        return result, local_in_form(local, local_form)

    @staticmethod
    def _ordered(sent: str, sent_batch: Tensor, fixed_batch: Tensor) -> tuple[Tensor, Tensor]:
        """(P, Q) from the sent and the fixed factor."""
        return (sent_batch, fixed_batch) if sent == "p" else (fixed_batch, sent_batch)
