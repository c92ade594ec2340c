"""The timeline model of one synchronised backward, and the exact search for the best fusion plan.

A plan cuts the ``N`` gradient tensors (in gradient-ready order) into contiguous buckets. For bucket
``b`` holding tensors ``i+1..j`` (``n_b`` elements):

- the device runs backward and the encodes one after the other (compression shares the device with
  backward; on the CPU it runs inside the gradient hook): tensor ``j`` is ready at ``r_j + Σ
  encodes of the earlier buckets``, ``r_j`` its ready time in a backward without synchronisation, and
  the bucket's encode ``enc(n_b)`` starts then; it launches at ``L_b = r_j + Σ_{b' ≤ b} enc(n_b')``;
- the network runs one collective at a time: the bucket's communication ``comm(n_b)`` (all its
  rounds) and the device work between its rounds ``btw(n_b)`` (PowerSGD's orthogonalisation: the
  next round waits for it) run from ``max(L_b, C_{b-1})`` to ``C_b``;
- decode runs at the end: all decodes follow the end of backward ``B = r_N + Σ_b enc(n_b)``, and the
  last bucket's decode follows its collective (earlier buckets' decodes overlap the collectives
  still running). The work between rounds occupies the device too; it is counted in the device's
  total, not in the launches (it runs when a round returns, mostly after backward):
  ``T = max(B + Σ_b (btw(n_b) + dec(n_b)), C_m + dec(n_m))`` for ``m`` buckets.

An exchange with an eager round (:class:`~gc_strategy.communicators.Round`: a variable-size
gather's lengths, PowerSGD's P, the node's reduce of ``hierarchy="node"``) goes on only when the
synchroniser advances it: at the launch of a later bucket of at least ``EAGER_AFTER_BYTES``, or at the end
of backward. With ``CostModel.advance_at`` (that size in elements) its collective runs from
``max(A_b, C_{b-1})`` instead, ``A_b`` that launch: all of it, which is exact where the first
round is a length handshake, near it for the node's reduce (device time on CPU ranks, a fast link
otherwise) and pessimistic for PowerSGD, whose P (about half its bytes) goes at the bucket's own
launch. With few large buckets this decides whether the exchanges overlap backward.

With ``hierarchy="node"`` the ``L`` ranks of a node share the buckets (:class:`Node`): bucket ``b``
has one owner ``o(b)`` (:func:`bucket_owners`), which alone encodes it, does its work between rounds
and decodes it; every rank of the node also pays ``red(n_b)`` before the launch (the node's sum
onto the owner) and ``bc(n_b)`` with the decodes (the owner's average back), where those collectives
take the device's time. Each rank ``o`` runs the timeline above with its own work: the bucket
launches at ``L_b = r_j + Σ_{b' ≤ b} (red(n_b') + [o(b') = o] enc(n_b'))`` for ``o = o(b)``, and
``T = max(max_o (B_o + Σ_b ([o(b) = o] (btw + dec) + bc)), C_m + dec(n_m) + bc(n_m))``. The search
runs on each rank's mean (:meth:`Node.mean`), as the synchroniser's planner measures it.

``enc``, ``dec`` and ``comm`` are :class:`Cost` curves: piecewise linear through measured
``(elements, seconds)`` points (a fixed cost shows at small sizes; on a CPU the cost per element grows
once a bucket no longer fits in cache, which a single straight line would miss). The simulated
iteration time adds ``other``: forward, the backward before the first gradient, the optimizer and
data loading, which no plan changes.

Search (:func:`best_plan`), exact over all ``2^(N-1)`` contiguous plans: a label-setting dynamic
programme over prefixes. A prefix ending at tensor ``j`` matters to the rest of the plan only
through four numbers, ``(Σ enc, C, W, Σ (enc + btw + dec))``: the encodes so far delay every
later launch; ``C`` is where the network is free and ``W`` the communication still waiting to be
advanced (exchanges advanced together run back to back, so only their sum matters; 0 when nothing
waits); the decodes enter ``T`` only through the device's total. ``T`` is non-decreasing in each,
so of the prefixes ending at ``j`` only the Pareto-minimal labels are kept (a dominated one can
never end a better plan; with ``Σ dec`` as the last number instead, 3.5x as many labels were kept
in the example below). Branch and bound prunes a label whose lower bound ``max(r_N + Σ (enc + btw
+ dec) + R_j, C + W + R'_j)`` exceeds the time of the best plan known (``R_j``: the least ``Σ (enc
+ btw + dec)``, ``R'_j`` the least ``Σ (comm + btw)`` + last decode, of any cut of the remaining
tensors: exact small DPs). The best plan known starts as the best fixed plan and improves as the
search goes: every kept prefix, ended by one bucket of all the remaining tensors, is a plan.
On ResNet-101's 314 tensors with an efsignsgd profile measured on the CPU (flat communication
costs, so many plans are within microseconds of each other) the search took 7.6 s without these
two refinements, 2.0 s with the first and 0.2 s with both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import isotonic_regression


@dataclass(frozen=True)
class Cost:
    """Seconds as a function of a bucket's element count ``n``: linear interpolation through the
    points ``(sizes[i], seconds[i])``, the first value below the first size, and beyond the last
    size the last segment's slope."""

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"cost points need increasing sizes with one time each; got {self.sizes}, {self.seconds}")

    @classmethod
    def linear(cls, fixed: float, per_element: float) -> Cost:
        """``fixed + per_element · n``."""
        return cls((0.0, 1.0), (fixed, fixed + per_element))

    @classmethod
    def measured(cls, sizes, seconds) -> Cost:
        """From measurements: a repeated size takes the median of its times, and times that fall
        as the size grows are pooled into their weighted mean (isotonic regression, scipy's pool
        adjacent violators; weights: the measurements per size). A larger bucket does not cost
        less; such dips are noise (page faults, a timer tick), and they let the plan search keep
        far more partial plans, so that the search slows by an order of magnitude on a noisy
        profile."""
        by_size: dict[float, list[float]] = {}
        for size, value in zip(sizes, seconds):
            by_size.setdefault(float(size), []).append(max(float(value), 0.0))
        ordered = sorted(by_size)
        medians = [float(np.median(by_size[size])) for size in ordered]
        fitted = isotonic_regression(medians, weights=[len(by_size[size]) for size in ordered]).x
        return cls(tuple(ordered), tuple(float(t) for t in fitted))

    def __call__(self, n):
        n = np.asarray(n, dtype=float)
        sizes, seconds = np.asarray(self.sizes), np.asarray(self.seconds)
        if len(sizes) == 1:
            slope = seconds[0] / sizes[0] if sizes[0] > 0 else 0.0
        else:
            slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
        out = np.where(n > sizes[-1], seconds[-1] + slope * (n - sizes[-1]), np.interp(n, sizes, seconds))
        return out if out.ndim else float(out)

    def scaled(self, factor: float) -> Cost:
        return Cost(self.sizes, tuple(factor * t for t in self.seconds))

    def __add__(self, other: Cost) -> Cost:
        """The sum of two costs: exact, through the union of their sizes (both are linear between
        the union's points and beyond its last, and constant below its first)."""
        sizes = tuple(sorted(set(self.sizes) | set(other.sizes)))
        return Cost(sizes, tuple(float(self(n) + other(n)) for n in sizes))


@dataclass(frozen=True)
class CostModel:
    """What the timeline needs, measured by the profiler (seconds, elements)."""

    ready: tuple[float, ...]  # r_j: ready time of each tensor after the first, without synchronisation
    numels: tuple[int, ...]  # elements of each tensor, in gradient-ready order
    encode: Cost
    comm: Cost
    decode: Cost
    other: float = 0.0  # the rest of the iteration: forward, optimizer, data
    between: Cost = Cost.linear(0.0, 0.0)  # device work between a bucket's rounds
    #: elements: an exchange waits (for an eager round) until the launch of a later bucket at least
    #: this large, or the end of backward; None: it goes on at its own launch
    advance_at: float | None = None

    def __post_init__(self) -> None:
        if len(self.ready) != len(self.numels) or not self.numels:
            raise ValueError(
                f"cost model needs one ready time per tensor; got {len(self.ready)} and {len(self.numels)}"
            )

    def scaled(self, compression: float, communication: float) -> CostModel:
        """The same model with encode, decode and between-round times times ``compression`` and
        communication times times ``communication``."""
        return CostModel(
            self.ready,
            self.numels,
            self.encode.scaled(compression),
            self.comm.scaled(communication),
            self.decode.scaled(compression),
            self.other,
            self.between.scaled(compression),
            self.advance_at,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        costs = {
            key: Cost(tuple(data[key]["sizes"]), tuple(data[key]["seconds"]))
            for key in ("encode", "comm", "decode", "between")
            if key in data
        }
        return cls(
            tuple(data["ready"]),
            tuple(data["numels"]),
            other=data.get("other", 0.0),
            advance_at=data.get("advance_at"),
            **costs,
        )


def bucket_owners(nbytes: list[int], ranks_per_node: int) -> list[int]:
    """The local rank that compresses each bucket (``hierarchy="node"``): in bucket order, each to
    the local rank with the fewest bytes so far (the lowest such rank on a tie). The same on every
    rank."""
    load = [0] * ranks_per_node
    owners = []
    for size in nbytes:
        owner = min(range(ranks_per_node), key=lambda local: (load[local], local))
        load[owner] += size
        owners.append(owner)
    return owners


@dataclass(frozen=True)
class Node:
    """The ``ranks`` of a node sharing its buckets (``hierarchy="node"``): a bucket's owner alone
    pays a :class:`CostModel`'s encode, between and decode of it, and every rank pays ``reduce``
    before its launch and ``broadcast`` with the decodes (zero where those collectives run beside
    the device, as over NVLink)."""

    ranks: int
    reduce: Cost = Cost.linear(0.0, 0.0)
    broadcast: Cost = Cost.linear(0.0, 0.0)

    def mean(self, model: CostModel) -> CostModel:
        """The costs of one rank of the node on average: its reduces and broadcasts, ``1/L`` of the
        coding, and every round held by the owner's whole work between rounds."""
        share = 1 / self.ranks
        return CostModel(
            model.ready,
            model.numels,
            self.reduce + model.encode.scaled(share),
            model.comm + model.between.scaled(1 - share),
            self.broadcast + model.decode.scaled(share),
            model.other,
            model.between.scaled(share),
            model.advance_at,
        )


def simulate(model: CostModel, cut: list[int], node: Node | None = None) -> float:
    """Simulated iteration time of the plan ``cut`` (tensors per bucket), step by step; on a
    ``node`` whose ranks share the buckets, the latest rank's."""
    if sum(cut) != len(model.numels) or any(g < 1 for g in cut):
        raise ValueError(f"plan {cut} does not cover {len(model.numels)} tensors")
    ends = np.cumsum(cut)
    cumulative = np.concatenate([[0], np.cumsum(model.numels, dtype=np.float64)])
    sizes = cumulative[ends] - cumulative[ends - np.asarray(cut)]
    encode, decode, between = (np.asarray(cost(sizes)) for cost in (model.encode, model.decode, model.between))
    node = node or Node(1)
    # by elements: the same deal as by bytes
    owners = bucket_owners(sizes.tolist(), node.ranks) if node.ranks > 1 else [0] * len(cut)
    owns = np.arange(node.ranks)[:, None] == np.asarray(owners)[None, :]  # [rank, bucket]
    reduce, broadcast = np.asarray(node.reduce(sizes)), np.asarray(node.broadcast(sizes))
    before = reduce + owns * encode  # each rank's device work up to each launch
    clocks = (np.asarray(model.ready)[ends - 1] + np.cumsum(before, axis=1)).tolist()  # [rank][bucket]: launches
    comm = (np.asarray(model.comm(sizes)) + between).tolist()
    network = 0.0
    if model.advance_at is None:
        for b, owner in enumerate(owners):
            network = max(network, clocks[owner][b]) + comm[b]
    else:
        waiting = []
        for b, advances in enumerate((sizes >= model.advance_at).tolist()):
            if advances:
                for w in waiting:  # advanced on their owners, at this launch
                    network = max(network, clocks[owners[w]][b]) + comm[w]
                waiting = []
            waiting.append(b)
        for w in waiting:  # the end of backward advances the rest
            network = max(network, clocks[owners[w]][-1]) + comm[w]
    device = model.ready[-1] + (before + owns * (between + decode) + broadcast).sum(axis=1).max()
    return float(model.other + max(device, network + decode[-1] + broadcast[-1]))


def _pareto(labels: np.ndarray, chunk: int = 128) -> np.ndarray:
    """Indices of the rows of ``[n, k]`` ``labels`` that no other row dominates (≤ in every column;
    of equal rows the first is kept). After a lexicographic sort a row can only be dominated by one
    sorted before it, which is already ≤ in the first column; and if it is dominated at all, it is
    dominated by a kept row (dominance is transitive). So each chunk of rows is compared with the
    front kept so far and with the chunk's earlier rows: ``O(n (front + chunk))``, not ``O(n²)``
    (fronts of a few hundred out of tens of thousands of labels are usual: 45 s -> 3.2 s for the
    search in :meth:`Cost.measured`'s example before its costs were made monotone)."""
    order = np.lexsort(labels.T[::-1])
    rest = labels[order, 1:]
    front = np.zeros(0, dtype=np.int64)  # kept rows, as positions in ``order``
    for start in range(0, len(order), chunk):
        rows = np.arange(start, min(start + chunk, len(order)))
        mine = rest[rows, None, :]
        by_front = (rest[None, front] <= mine).all(axis=2).any(axis=1)
        earlier = rows[None, :] < rows[:, None]
        by_chunk = (earlier & (rest[None, rows] <= mine).all(axis=2)).any(axis=1)
        front = np.concatenate([front, rows[~(by_front | by_chunk)]])
    return order[front]


def best_plan(model: CostModel) -> tuple[list[int], float]:
    """The plan with the smallest :func:`simulate` time (on one rank) over all contiguous
    partitions (exact; see the module docstring), and that time."""
    count, advance_at = len(model.numels), model.advance_at
    ready = np.asarray(model.ready, dtype=float)
    elements = np.concatenate([[0.0], np.cumsum(np.asarray(model.numels, dtype=float))])
    sizes = elements[None, 1:] - elements[:-1, None]  # [i, j-1]: elements of tensors i+1..j
    valid = np.triu(np.ones((count, count), dtype=bool))
    enc, dec, comm, btw = (
        np.where(valid, cost(sizes), np.inf) for cost in (model.encode, model.decode, model.comm, model.between)
    )
    device = enc + btw + dec  # a bucket's work on the device
    comm = comm + btw  # its next round waits for the work between rounds
    # least Σ (enc + btw + dec), and least Σ (comm + btw) + last decode, over the cuts of tensors j+1..N
    rest_device, rest_network = np.zeros(count + 1), np.zeros(count + 1)
    for j in range(count - 1, -1, -1):
        rest_device[j] = np.min(device[j, j:] + rest_device[j + 1 :])
        rest_network[j] = min(
            np.min(comm[j, j:-1] + rest_network[j + 1 : -1], initial=np.inf), comm[j, -1] + dec[j, -1]
        )

    def extended(prefixes: np.ndarray, start: int | np.ndarray, stop: int) -> np.ndarray:
        """The labels of prefixes (rows of ``prefixes``) ending at ``start`` (one per row, or one for
        all) with the bucket of tensors ``start+1..stop`` appended."""
        encoded = prefixes[:, 0] + enc[start, stop - 1]  # gathered once per label
        network, waiting = prefixes[:, 1], prefixes[:, 2]
        launched = np.maximum(network, ready[stop - 1] + encoded)
        if advance_at is None:
            network, waiting = launched + comm[start, stop - 1], np.zeros_like(waiting)
        else:  # a large bucket's launch advances the exchanges waiting; this one waits in turn
            advances = sizes[start, stop - 1] >= advance_at
            network = np.where(advances, launched + waiting, network)
            waiting = np.where(advances, 0.0, waiting) + comm[start, stop - 1]
        return np.stack([encoded, network, waiting, prefixes[:, 3] + device[start, stop - 1]], 1)

    def finished(prefixes: np.ndarray, start: int | np.ndarray) -> np.ndarray:
        """``T`` (less ``other``) of the plans that end these prefixes with one bucket of the rest."""
        last = extended(prefixes, start, count)
        network = np.maximum(last[:, 1], ready[-1] + last[:, 0]) + last[:, 2]  # the end of backward advances
        return np.maximum(ready[-1] + last[:, 3], network + dec[start, -1])

    best_cut = min(_starting_plans(model.numels), key=lambda g: simulate(model, g))
    bound = simulate(model, best_cut) - model.other
    # every kept prefix ("label"): where it ends, (Σ enc, C, W, Σ (enc + btw + dec)), and the label it extends
    ends, labels, parents = np.zeros(1, dtype=np.int64), np.array([[0.0, -np.inf, 0.0, 0.0]]), np.full(1, -1)
    for j in range(1, count):
        new = extended(labels, ends, j)
        lower = np.maximum(ready[-1] + new[:, 3] + rest_device[j], new[:, 1] + new[:, 2] + rest_network[j])
        alive = np.flatnonzero(lower <= bound)
        if len(alive):
            kept = alive[_pareto(new[alive])]
            # each kept prefix ended by one bucket of the rest is a plan: the best of them bounds the search
            bound = min(bound, float(finished(new[kept], j).min()))
            ends = np.concatenate([ends, np.full(len(kept), j)])
            labels = np.concatenate([labels, new[kept]])
            parents = np.concatenate([parents, kept])
    totals = finished(labels, ends)  # the same arithmetic as the bounds above: the best plan's total is ≤ bound
    label = int(np.argmin(totals))
    if totals[label] <= bound:
        bound, cuts = float(totals[label]), [count]
        while label > 0:
            cuts.append(int(ends[label]))
            label = int(parents[label])
        cuts.append(0)
        cuts.reverse()
        best_cut = [b - a for a, b in zip(cuts, cuts[1:])]
    return best_cut, float(model.other + bound)


def _starting_plans(numels: tuple[int, ...]) -> list[list[int]]:
    """Fixed plans whose best simulated time is the search's first bound."""
    from .plans import GroupsPlanner

    count = len(numels)
    return [[count], [1] * count] + [GroupsPlanner(n).plan(list(numels)) for n in (2, 4, 8, 16, 32, 64) if n < count]
