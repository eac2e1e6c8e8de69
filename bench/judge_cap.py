"""The judge's tail cap, vectorised over canaries and looks, for ``rtrl bench judge``.

At each look the judge clips every latency to the [1 - q, q] quantiles of both arms' requests
seen so far (``rollback.metrics.capped_cells``). Clipping every request again at every look
cost the benchmark minutes per scenario; here the quantiles come from each (canary, tick)'s
few largest and smallest requests (a look's top k are among its ticks' top k), and the
clipped sums are the plain ones corrected where a request was clipped (a few per thousand).
tests/unit/test_judge_bench.py checks the result against ``rollback.judge.judge``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from bench.judge_sim import Arm, metric_arrays, metric_sums
from rollback.stats import cap_factor, strata_difference

Arr = NDArray[np.float64]
IntArr = NDArray[np.int64]


def _owner(arm: Arm) -> IntArr:
    """Each request's cell (canary, tick, user), flat."""
    return np.repeat(np.arange(arm.n.size), np.diff(arm.offsets))


def _extremes(values: Arr, group: IntArr, groups: int, k: int) -> tuple[Arr, Arr]:
    """Each group's k largest (descending, padded with -inf) and k smallest (ascending, padded
    with +inf) values, (groups, k)."""
    order = np.argsort(values)
    kind = np.uint16 if groups <= 1 << 16 else np.int64  # 16-bit keys sort by radix, in one pass
    order = order[np.argsort(group[order].astype(kind), kind="stable")]  # by group, then value
    v, g = values[order], group[order]
    size = np.bincount(g, minlength=groups)
    start = np.concatenate([[0], np.cumsum(size)[:-1]])
    j = np.arange(k)
    take = j[None, :] < size[:, None]
    low = np.where(take, v[np.minimum(start[:, None] + j, max(v.size - 1, 0))], np.inf) if v.size else \
        np.full((groups, k), np.inf)
    high = np.where(take, v[np.maximum(start[:, None] + size[:, None] - 1 - j, 0)], -np.inf) if v.size else \
        np.full((groups, k), -np.inf)
    return high, low


def _grouped_extremes(values: Arr, group: IntArr, groups: int, k: int) -> tuple[Arr, Arr]:
    """``_extremes`` for ``group`` sorted (non-decreasing), as an arm's requests are: each group a
    row of a padded matrix, its k largest and smallest by a partition of the rows (linear, where
    sorting every request was most of the benchmark's time); a plain sort when one group is so
    much larger than the rest that the matrix would be."""
    size = np.bincount(group, minlength=groups)
    width = max(int(size.max(initial=0)), k)
    if groups * width > 4 * max(values.size, 1):
        return _extremes(values, group, groups, k)
    pos = np.arange(values.size) - np.concatenate([[0], np.cumsum(size)[:-1]])[group]
    rows = np.full((groups, width), -np.inf)
    rows[group, pos] = values
    high = -np.sort(np.partition(-rows, k - 1, axis=1)[:, :k], axis=1)  # descending
    rows[rows == -np.inf] = np.inf
    low = np.sort(np.partition(rows, k - 1, axis=1)[:, :k], axis=1)
    return high, low


def _order_stat(sorted_vals: Arr, h: Arr) -> Arr:
    """numpy's linear quantile from ascending order statistics: the value at virtual index h."""
    i = np.floor(h).astype(np.int64)
    frac = h - i
    a = np.take_along_axis(sorted_vals, i[:, None], axis=1)[:, 0]
    b = np.take_along_axis(sorted_vals, np.minimum(i + 1, sorted_vals.shape[1] - 1)[:, None], axis=1)[:, 0]
    with np.errstate(invalid="ignore"):  # b is padding (inf) only where frac is 0
        return np.where(frac == 0, a, np.where(frac >= 0.5, b - (b - a) * (1 - frac), a + (b - a) * frac))


def pooled_bounds(stable: Arm, canary: Arm, q: float) -> tuple[Arr, Arr]:
    """(lo, hi) per canary and look, (canaries, looks): the [1 - q, q] quantiles of both arms'
    requests in ticks up to the look; -inf/+inf before any request."""
    canaries, ticks = stable.n.shape[:2]
    groups = [_owner(a) // a.n.shape[2] for a in (stable, canary)]  # canary * ticks + tick, sorted
    counts = np.add(*(np.bincount(g, minlength=canaries * ticks) for g in groups)).reshape(canaries, ticks)
    seen = np.cumsum(counts, axis=1)  # requests pooled by each look
    k = math.ceil((1.0 - q) * max(int(seen.max(initial=0)), 1)) + 2
    arms = [_grouped_extremes(a.latencies, g, canaries * ticks, k)
            for a, g in zip((stable, canary), groups, strict=True)]
    high = -np.sort(-np.concatenate([h for h, _ in arms], axis=1), axis=1)[:, :k].reshape(canaries, ticks, k)
    low = np.sort(np.concatenate([lo for _, lo in arms], axis=1), axis=1)[:, :k].reshape(canaries, ticks, k)
    lo, hi = np.full((canaries, ticks), -np.inf), np.full((canaries, ticks), np.inf)
    for look in range(ticks):
        n = seen[:, look]
        has = n > 0
        if not has.any():
            continue
        top = -np.sort(-high[:, : look + 1].reshape(canaries, -1), axis=1)[:, :k]  # descending
        bottom = np.sort(low[:, : look + 1].reshape(canaries, -1), axis=1)[:, :k]  # ascending
        m = np.maximum(n - 1, 0).astype(np.float64)
        # ascending index h of the q quantile, read from the top: index n - 1 - h (<= k - 2)
        up = _order_stat(-top, np.maximum(m - m * q, 0.0))  # -top is ascending from -max
        lo[has, look] = _order_stat(bottom, m * (1.0 - q))[has]
        hi[has, look] = -up[has]
    return lo, hi


def capped_latency_looks(stable: Arm, canary: Arm, q: float,
                         cap: float | None) -> tuple[tuple[Arr, ...], ...]:
    """Each arm's per-tick sums (``metric_sums``) of latency at every look with every request
    clipped to that look's pooled bounds, (canaries, looks, ticks); ticks after the look are 0."""
    canaries, ticks = stable.n.shape[:2]
    lo, hi = pooled_bounds(stable, canary, q)
    seen = np.tril(np.ones((ticks, ticks)))
    out = []
    for arm in (stable, canary):
        base = metric_sums(arm.latency, arm.n, cap)  # (canaries, ticks)
        cell = _owner(arm)
        c = cell // (ticks * arm.n.shape[2])
        x = arm.latencies
        maybe = (x > hi.min(axis=1)[c]) | (x < lo.max(axis=1)[c])  # clipped at some look
        d = np.clip(x[maybe, None], lo[c[maybe]], hi[c[maybe]]) - x[maybe, None]  # (requests, looks)
        cells, inv = np.unique(cell[maybe], return_inverse=True)
        delta = np.zeros((cells.size, ticks))
        np.add.at(delta, inv, d)
        s, n = arm.latency.ravel()[cells], arm.n.ravel()[cells]
        f = cap_factor(n, cap)
        ds = delta * f[:, None]
        sf = (s * f)[:, None]
        parts = {0: ds, 2: (sf + ds) ** 2 - sf ** 2, 3: ds * (n * f)[:, None]}
        where = cells // arm.n.shape[2]  # canary * ticks + tick
        sums = []
        for i, total in enumerate(base):
            looked = np.repeat(total[:, None, :], ticks, axis=1)  # (canaries, looks, ticks)
            if i in parts:
                extra = np.zeros((canaries * ticks, ticks))
                np.add.at(extra, where, parts[i])
                looked = looked + extra.reshape(canaries, ticks, ticks).transpose(0, 2, 1)
            sums.append(looked * seen[None])
        out.append(tuple(sums))
    return tuple(out)


def stratified_by_tick(stable: Arm, canary: Arm, name: str, cap: float | None,
                       tail_q: float | None = None) -> tuple[Arr, Arr, Arr, Arr]:
    """(stable mean, canary mean, var stable, var canary) at every look, (canaries, looks);
    latency with both pooled tails clipped at each look when ``tail_q`` is given."""
    if name == "latency_ms" and tail_q is not None:
        s, c = capped_latency_looks(stable, canary, tail_q, cap)
        return strata_difference(s, c)
    seen = np.tril(np.ones((stable.n.shape[1],) * 2))
    s = tuple(x[:, None, :] * seen[None] for x in metric_sums(*metric_arrays(stable, name), cap))
    c = tuple(x[:, None, :] * seen[None] for x in metric_sums(*metric_arrays(canary, name), cap))
    return strata_difference(s, c)
