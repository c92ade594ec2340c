"""Low-rank gradient compression (ALGORITHMS.md §5): ``powersgd`` and ``acpsgd``.

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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..bucket import Bucket, all_finite
from ..comm import Communicator, Exchange
from ..registry import Option
from .base import COMPRESSORS, Compressor

LOWRANK_OPTIONS = {
    "rank": Option(4, int, low=1, help="r"),
    "start_iter": Option(10, int, low=0, help="steps of plain allreduce before compressing"),
    "min_compression_rate": Option(2.0, float, low=0.0, low_open=True),
    "use_error_feedback": Option(True, bool),
    "orthogonalization_epsilon": Option(0.0, float, low=0.0),
    "seed": Option(0, int, low=0, help="seed of the initial factors, shared by all ranks"),
}


def orthogonalize(matrices: Tensor, epsilon: float = 0.0) -> Tensor:
    """Orthonormalise the columns of a batch ``[b, n, r]`` in place.

    With ``epsilon = 0``: Householder QR, stable also when the columns are (nearly) dependent, e.g.
    a rank-r' factor of a matrix of lower rank (single-pass Gram–Schmidt loses orthogonality there).
    With ``epsilon > 0``: Gram–Schmidt with ``col /= ‖col‖ + ε``, as torch's ``powerSGD_hook``
    does, which keeps vanishing columns finite.
    """
    if epsilon == 0:
        matrices.copy_(torch.linalg.qr(matrices).Q)
        return matrices
    for i in range(matrices.shape[2]):
        col = matrices[:, :, i : i + 1]
        col /= torch.linalg.vector_norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < matrices.shape[2]:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    return matrices


@dataclass
class _Matrix:
    name: str
    offset: int
    rows: int
    cols: int
    rank: int


@dataclass
class _Layout:
    """Which parts of a bucket are compressed, grouped by shape for batching."""

    groups: dict[tuple, list[_Matrix]]
    dense: Tensor  # int64 positions of the densely averaged elements


class _LowRank(Compressor):
    summable = True
    allreduce_only = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.factors: dict[str, dict[str, Tensor]] = {"p": {}, "q": {}}
        self._layouts: dict[tuple[str, ...], _Layout] = {}

    # ---------------------------------------------------------------- layout
    @staticmethod
    def batch_by_shape(device: torch.device) -> bool:
        """Batch same-shape matrices into one ``bmm`` on a GPU (fewer kernel launches); one matrix
        per batch on the CPU, where a batch of several costs a copy of each matrix in and out."""
        return device.type == "cuda"

    def layout(self, bucket: Bucket) -> _Layout:
        key = tuple(bucket.names)
        if key not in self._layouts:
            groups: dict[tuple, list[_Matrix]] = {}
            dense_mask = torch.ones(bucket.numel, dtype=torch.bool)
            for name, shape, offset, numel in zip(bucket.names, bucket.shapes, bucket.offsets, bucket.numels):
                if len(shape) < 2:
                    continue
                rows, cols = shape[0], numel // shape[0]
                rank = min(self.options["rank"], rows, cols)
                if (rows + cols) * rank * self.options["min_compression_rate"] < rows * cols:
                    key = (rows, cols, rank) if self.batch_by_shape(bucket.device) else (rows, cols, rank, name)
                    groups.setdefault(key, []).append(_Matrix(name, offset, rows, cols, rank))
                    dense_mask[offset : offset + numel] = False
            dense = torch.nonzero(dense_mask).view(-1).to(bucket.device)
            self._layouts[key] = _Layout(groups, dense)
        return self._layouts[key]

    def compressed_elements(self, bucket: Bucket) -> tuple[int, int, int]:
        """(elements of all P factors, of all Q factors, dense elements) sent for this bucket."""
        layout = self.layout(bucket)
        p = sum(m.rows * m.rank for ms in layout.groups.values() for m in ms)
        q = sum(m.cols * m.rank for ms in layout.groups.values() for m in ms)
        return p, q, layout.dense.numel()

    # ---------------------------------------------------------------- factors
    def _initial(self, kind: str, m: _Matrix, bucket: Bucket, device: torch.device) -> Tensor:
        size = m.rows if kind == "p" else m.cols
        # seeded by (seed, parameter name, factor): the same on every rank and in every process
        generator = torch.Generator().manual_seed(self.options["seed"] * 1_000_003 + zlib.crc32(f"{kind}:{m.name}".encode()))
        return torch.randn(size, m.rank, generator=generator).to(device)

    def stacked_factor(self, kind: str, matrices: list[_Matrix], bucket: Bucket, device: torch.device) -> Tensor:
        """The stored factors of ``matrices`` as a batch ``[b, size, r]`` (initial ones from the shared seed)."""
        store = self.factors[kind]
        for m in matrices:
            if m.name not in store or not self.options.get("warm_start", True):
                store[m.name] = self._initial(kind, m, bucket, device)
        return torch.stack([store[m.name] for m in matrices]).to(device)

    def keep_factors(self, kind: str, matrices: list[_Matrix], batch: Tensor, finite: Tensor) -> None:
        """Store the factors for the next step (not from a bucket holding inf/NaN)."""
        store = self.factors[kind]
        for m, value in zip(matrices, batch):
            store[m.name] = value.clone() if m.name not in store else torch.where(finite, value, store[m.name])

    # ---------------------------------------------------------------- shared pieces
    def _compensated(self, flat: Tensor, bucket: Bucket) -> Tensor:
        g = flat.float()
        return g + self.buffer("error", bucket) if self.options["use_error_feedback"] else g

    @staticmethod
    def _matrices(m_flat: Tensor, matrices: list[_Matrix]) -> Tensor:
        """The batch ``[b, rows, cols]`` of same-shape matrices: a view of ``m_flat`` when there is
        one, a stacked copy otherwise."""
        views = [m_flat[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols) for m in matrices]
        return views[0].unsqueeze(0) if len(views) == 1 else torch.stack(views)

    @classmethod
    def _write_product(cls, out: Tensor, matrices: list[_Matrix], p: Tensor, q: Tensor) -> None:
        """``P Qᵀ`` of each matrix into its place in the flat ``out`` (directly, for a batch of one)."""
        if len(matrices) == 1:
            torch.bmm(p, q.transpose(1, 2), out=cls._matrices(out, matrices))
            return
        for m, value in zip(matrices, torch.bmm(p, q.transpose(1, 2))):
            out[m.offset : m.offset + m.rows * m.cols] = value.reshape(-1)

    def _keep_error(self, m_flat: Tensor, approximation: Tensor, bucket: Bucket, finite: Tensor) -> None:
        """``e = M - approximation`` on the compressed matrices (dense parts are exact: no error)."""
        if not self.options["use_error_feedback"]:
            return
        error = self.buffer("error", bucket)
        torch.where(finite, m_flat - approximation, error, out=error)
        error[self.layout(bucket).dense] = 0

    def _dense_exchange(self, flat: Tensor, comm: Communicator, need_local: bool) -> Exchange:
        """Plain allreduce of the whole bucket (before ``start_iter``, or nothing to compress)."""
        local = flat.float()
        (summed,) = yield from comm.exchange([local.clone()], False)
        return summed.div_(comm.world_size), local if need_local else None

    def extra_state(self) -> dict[str, Any]:
        return {"factors": {kind: dict(store) for kind, store in self.factors.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.factors = {kind: dict(store) for kind, store in state.get("factors", {"p": {}, "q": {}}).items()}

    def _split(self, summed: Tensor, sizes: list[int]) -> list[Tensor]:
        return list(torch.split(summed, sizes))


@COMPRESSORS.register("powersgd")
class PowerSGD(_LowRank):
    """PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019), one power iteration per step, for all
    compressible matrices of a bucket at once:

    1. ``M ← M + e`` (``use_error_feedback``);
    2. ``Q``: last step's (``warm_start``) or a Gaussian from a seed all ranks share; orthogonalised;
    3. ``P = M Q``; allreduce-sum all P (and the dense part) in one buffer; orthogonalise each P;
    4. ``Q = Mᵀ P``; allreduce-sum all Q in one buffer; ``Q ← Q / W``;
    5. ``ĝ = P Qᵀ``; ``e = M - ĝ`` (local input minus the global approximation).

    Like torch's ``powerSGD_hook`` the warm-started Q is re-orthogonalised every step (the result
    ``P Pᵀ M̄`` does not depend on it in exact arithmetic; it keeps the iteration well conditioned).
    Unlike the hook, the densely averaged tensors carry no error feedback: their average is exact.
    """

    OPTIONS = {**LOWRANK_OPTIONS, "warm_start": Option(True, bool)}

    def exchange(self, flat: Tensor, bucket: Bucket, comm: Communicator, need_local: bool) -> Exchange:
        layout = self.layout(bucket)
        if self.step < self.options["start_iter"] or not layout.groups:
            return (yield from self._dense_exchange(flat, comm, need_local))
        eps = self.options["orthogonalization_epsilon"]
        finite = all_finite(flat)
        m_flat = self._compensated(flat, bucket)
        groups = list(layout.groups.items())
        mats = [self._matrices(m_flat, ms) for _, ms in groups]
        qs = [orthogonalize(self.stacked_factor("q", ms, bucket, flat.device), eps) for _, ms in groups]
        ps = [torch.bmm(m, q) for m, q in zip(mats, qs)]
        first = torch.cat([p.reshape(-1) for p in ps] + [m_flat[layout.dense]])
        (summed,) = yield from comm.exchange([first], False)
        pieces = self._split(summed, [p.numel() for p in ps] + [layout.dense.numel()])
        ps = [orthogonalize(piece.view_as(p), eps) for piece, p in zip(pieces, ps)]
        qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(mats, ps)]
        (summed_q,) = yield from comm.exchange([torch.cat([q.reshape(-1) for q in qs])], False)
        qs = [piece.view_as(q).div_(comm.world_size) for piece, q in zip(self._split(summed_q, [q.numel() for q in qs]), qs)]
        result = torch.empty_like(m_flat)  # every element is written: the dense part, then each matrix
        result[layout.dense] = pieces[-1] / comm.world_size
        for (_, ms), p, q in zip(groups, ps, qs):
            self._write_product(result, ms, p, q)
            self.keep_factors("q", ms, q, finite)
        self._keep_error(m_flat, result, bucket, finite)
        return result, result if need_local else None


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

    def is_p_step(self) -> bool:
        return (self.step - self.options["start_iter"]) % 2 == 0

    def exchange(self, flat: Tensor, bucket: Bucket, comm: Communicator, need_local: bool) -> Exchange:
        if self.step < self.options["start_iter"]:
            return (yield from self._dense_exchange(flat, comm, need_local))
        layout = self.layout(bucket)
        eps = self.options["orthogonalization_epsilon"]
        finite = all_finite(flat)
        m_flat = self._compensated(flat, bucket)
        groups = list(layout.groups.items())
        mats = [self._matrices(m_flat, ms) for _, ms in groups]
        sent, fixed = ("p", "q") if self.is_p_step() else ("q", "p")
        fixed_factors = [orthogonalize(self.stacked_factor(fixed, ms, bucket, flat.device), eps) for _, ms in groups]
        if sent == "p":
            factors = [torch.bmm(m, q) for m, q in zip(mats, fixed_factors)]
        else:
            factors = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(mats, fixed_factors)]
        local = torch.empty_like(m_flat)  # every element is written: the dense part, then each matrix
        local[layout.dense] = m_flat[layout.dense]
        for (_, ms), fac, fix in zip(groups, factors, fixed_factors):
            p, q = (fac, fix) if sent == "p" else (fix, fac)
            self._write_product(local, ms, p, q)
        self._keep_error(m_flat, local, bucket, finite)
        payload = torch.cat([f.reshape(-1) for f in factors] + [m_flat[layout.dense]])
        (summed,) = yield from comm.exchange([payload], False)
        pieces = self._split(summed.div_(comm.world_size), [f.numel() for f in factors] + [layout.dense.numel()])
        result = torch.empty_like(m_flat)
        result[layout.dense] = pieces[-1]
        for (_, ms), piece, fac, fix in zip(groups, pieces, factors, fixed_factors):
            averaged = piece.view_as(fac)
            p, q = (averaged, fix) if sent == "p" else (fix, averaged)
            self._write_product(result, ms, p, q)
            self.keep_factors(sent, ms, averaged, finite)
            self.keep_factors(fixed, ms, fix, finite)
        return result, local if need_local else None
