"""Building a dispatch map: a coarse grid, then grid lines added where the winner changes.

Between two neighbouring grid lines whose points have different winners somewhere along the other
axis, a new line is added at their geometric mean (bisection in log space), and every point on it is
measured. This repeats until each crossover is located within ``resolution`` octaves (a quarter
octave by default; for batches, until no integer lies between), or one of the two rivals is within
the switch margin of the other on both sides (then it does not matter where exactly they cross).

The measurement is a callable, so that tests plant timings and ``tune`` measures in its worker:
``measure(batch, context, labels)`` returns a :class:`PointMeasurement` for those candidates (``None``:
every candidate of the space). New points measure only the contenders of their measured neighbours
(:func:`contenders`), and the default where a neighbour measured it. Before the first split, a
coarse point that lacks the winner of a neighbour on its grid lines is measured again with it
(:func:`_complete`), so that the coarse grid's splits are decided on the two winners' times, not on a
missing one. (Between new points a missing winner still splits, as before: there it is the
refinement's own conservative choice, and it locates crossovers that the margin policy alone, on
narrow intervals, would leave a few percent off.)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from attnbench.tables.dispatch import DispatchMap, GridPoint, MapCandidate
from attnbench.tables.margin import SWITCH_MARGIN, Interval, beats, decide

__all__ = [
    "Measure",
    "PointMeasurement",
    "contenders",
    "grid_point",
    "refine_map",
    "significant",
]

#: Refinement stops when the two lines are this many octaves apart (or fewer).
RESOLUTION = 0.25


@dataclass
class PointMeasurement:
    """What measuring one point gave: intervals of the timed candidates, failures with reasons."""

    times: dict[str, Interval]
    failed: dict[str, str] = field(default_factory=dict)
    candidates: dict[str, MapCandidate] = field(default_factory=dict)
    load_avg: tuple[float, ...] = ()
    evaluations: int = 0  # candidates run in a worker for this point
    #: why the candidates were timed one at a time instead of interleaved (the interleaved run's
    #: worker died: killed for memory, or a candidate crashed it); "" when they were interleaved
    isolated: str = ""


Measure = Callable[[int, int, Sequence[str] | None], PointMeasurement]


def grid_point(
    batch: int, context: int, m: PointMeasurement, *, default: str | None, margin: float = SWITCH_MARGIN
) -> GridPoint:
    """The grid point for a measurement, with its winner decided by the margin policy."""
    verdict = decide(m.times, default=default, margin=margin)
    return GridPoint(
        batch=batch,
        context=context,
        times=dict(m.times),
        winner=verdict.winner,
        tie=verdict.tie,
        failed=dict(m.failed),
        load_avg=tuple(m.load_avg) or tuple(os.getloadavg()),
        reason=verdict.reason,
    )


def significant(p: GridPoint, q: GridPoint, *, margin: float = SWITCH_MARGIN) -> bool:
    """``p`` and ``q`` have different winners and where they cross matters: each side's winner beats
    the other side's winner there by the margin policy (the switch margin beyond both intervals; one
    a study pruned there counts as beaten), or one of them failed on the other side.

    When one of the two is within the margin of the other on *both* sides, choosing it anywhere
    between them costs at most the margin (times are interpolated linearly in log-log space), so the
    crossover need not be located: two configs that trade places by a few percent, or by noise, do
    not refine.
    """
    a, b = p.winner, q.winner
    if a is None or b is None or a == b:
        return False
    if _failed(p, b) or _failed(q, a):  # one of them failed on the other side: it matters
        return True
    return _behind(p, a, b, margin=margin) and _behind(q, b, a, margin=margin)


def _failed(point: GridPoint, label: str) -> bool:
    """``label`` has no time at ``point`` and was not stopped there by a study's pruner (failed, or
    never measured there)."""
    return label not in point.times and not point.failed.get(label, "").startswith("pruned")


def _behind(point: GridPoint, winner: str, rival: str, *, margin: float) -> bool:
    """At ``point``, ``rival`` is slower than ``winner`` beyond both intervals by the margin, or was
    pruned there: a study's pruner stopped it as clearly slower after a few steps, a verdict on its
    speed, not a failure (counted as one, a neighbour's winner pruned at 1 × 8k set off two rounds of
    refinement on the AMX Xeon, 234 evaluations, where at 1 × 1k the two winners were within 3 %)."""
    return rival not in point.times or beats(point.times[winner], point.times[rival], margin=margin)


def _midpoint(lo: int, hi: int, *, resolution: float) -> int | None:
    if math.log2(hi / lo) <= resolution + 0.01:  # integer lines: a quarter octave up to rounding
        return None
    mid = round(math.sqrt(lo * hi))
    return mid if lo < mid < hi else None


def _splits(
    m: DispatchMap,
    along: Sequence[int],
    across: Sequence[int],
    key: Callable[[int, int], tuple[int, int]],
    *,
    resolution: float,
) -> set[int]:
    """Midpoints of neighbouring values of ``along`` (one axis) between which the winner changes
    significantly at some value of ``across`` (the other); ``key(a, x)`` is the grid key of a point."""
    new: set[int] = set()
    for lo, hi in pairwise(along):
        mid = _midpoint(lo, hi, resolution=resolution)
        if mid is not None and any(
            key(lo, x) in m.points
            and key(hi, x) in m.points
            and significant(m.points[key(lo, x)], m.points[key(hi, x)], margin=m.switch_margin)
            for x in across
        ):
            new.add(mid)
    return new


def _neighbours(m: DispatchMap, b: int, c: int) -> list[GridPoint]:
    """Measured points next to (b, c) along each axis (the nearest on each side)."""
    out: list[GridPoint] = []
    along_b = [(x, c) for x in m.batches if (x, c) in m.points]
    along_c = [(b, x) for x in m.contexts if (b, x) in m.points]
    for keys, coord, axis in ((along_b, b, 0), (along_c, c, 1)):
        below = [k for k in keys if k[axis] < coord]
        above = [k for k in keys if k[axis] > coord]
        if below:
            out.append(m.points[below[-1]])
        if above:
            out.append(m.points[above[0]])
    return out


def contenders(p: GridPoint, *, margin: float = SWITCH_MARGIN) -> list[str]:
    """Candidates still in the running at ``p``: its winner, and every one whose interval reaches the
    best's or whose median is within twice the switch margin of it."""
    if not p.times:
        return []
    best = min(p.times.values(), key=lambda t: t.median_ms)
    near = [
        k
        for k, t in sorted(p.times.items(), key=lambda kv: kv[1].median_ms)
        if t.lo_ms <= best.hi_ms or t.median_ms <= (1 + 2 * margin) * best.median_ms
    ]
    return ([p.winner] if p.winner and p.winner not in near else []) + near


def _labels_for(m: DispatchMap, b: int, c: int) -> list[str]:
    """What a new point measures: the default where a neighbour measured it (its corners then hold it:
    the margin policy keeps it on a tie), and its neighbours' contenders (:func:`contenders`). A default
    that no neighbour re-timed — it was no finalist there, far behind — is not measured again: at
    batch 8 between 8k and 32k tokens one step of the CPU's default takes 17 s, 35 × the winner's."""
    around = _neighbours(m, b, c)
    near = [k for p in around for k in contenders(p, margin=m.switch_margin)]
    default = [m.default] if m.default and any(m.default in p.times for p in around) else []
    return list(dict.fromkeys([*default, *near]))


def refine_map(
    m: DispatchMap,
    measure: Measure,
    *,
    resolution: float = RESOLUTION,
    max_points: int = 200,
    on_point: Callable[[GridPoint], None] | None = None,
) -> int:
    """Add grid lines to ``m`` until its crossovers are located; returns the evaluations used."""
    evaluations = 0
    rounds = 0
    added_b: list[int] = []
    added_c: list[int] = []
    evaluations += _complete(m, measure, on_point=on_point)  # the coarse points, before any split
    while True:
        evaluations += _fill(m, measure, max_points=max_points, on_point=on_point)
        new_b = _splits(m, m.batches, m.contexts, lambda b, c: (b, c), resolution=resolution)
        new_c = _splits(m, m.contexts, m.batches, lambda c, b: (b, c), resolution=resolution)
        if not (new_b or new_c) or len(m.points) >= max_points:
            break
        rounds += 1
        added_b += sorted(new_b)
        added_c += sorted(new_c)
        m.add_lines(batches=sorted(new_b), contexts=sorted(new_c))
    m.refinement = {
        "resolution_octaves": resolution,
        "rounds": rounds,
        "added_batches": added_b,
        "added_contexts": added_c,
        "evaluations": m.refinement.get("evaluations", 0) + evaluations,
        "points": len(m.points),
        "complete": m.complete(),
    }
    return evaluations


def _fill(
    m: DispatchMap, measure: Measure, *, max_points: int, on_point: Callable[[GridPoint], None] | None
) -> int:
    """Measure every grid point not measured yet (only its neighbours' finalists)."""
    evaluations = 0
    missing = [(b, c) for b in m.batches for c in m.contexts if (b, c) not in m.points]
    for b, c in missing:
        if len(m.points) >= max_points:
            break
        labels = _labels_for(m, b, c) or None
        got = measure(b, c, labels)
        for k, cand in got.candidates.items():
            m.candidates.setdefault(k, cand)
        evaluations += got.evaluations or len(got.times) + len(got.failed)
        m.points[(b, c)] = point = grid_point(b, c, got, default=m.default, margin=m.switch_margin)
        if on_point is not None:
            on_point(point)
    return evaluations


def _complete(m: DispatchMap, measure: Measure, *, on_point: Callable[[GridPoint], None] | None) -> int:
    """Measure again, whole, each point of ``m`` that lacks the winner of a neighbour on its grid lines
    (neither timed nor failed there): its candidates and those winners in one interleaved run.
    :func:`refine_map` calls it on the coarse grid, whose points are the keys' re-timings.

    Without that winner's time at the point, the two cannot be compared there and :func:`significant`
    must split the segment; the new line's points measure both winners, but the point itself still
    lacks one, so the split repeats down to the resolution. On the AMX Xeon one coarse point of the
    grid whose re-timing had not taken its neighbour's winner (a candidate that neighbour took from a
    third key) set off three rounds and 18 new points, 800 s; measuring the missing winner there
    costs one point."""
    evaluations = 0
    for (b, c), p in sorted(m.points.items()):
        missing = {
            q.winner
            for q in _neighbours(m, b, c)
            if q.winner is not None and q.winner not in p.times and q.winner not in p.failed
        }
        if not missing:
            continue
        got = measure(b, c, sorted(set(p.times) | missing))
        for k, cand in got.candidates.items():
            m.candidates.setdefault(k, cand)
        evaluations += got.evaluations or len(got.times) + len(got.failed)
        got.failed = {k: v for k, v in p.failed.items() if k not in got.times} | got.failed
        m.points[(b, c)] = point = grid_point(b, c, got, default=m.default, margin=m.switch_margin)
        if on_point is not None:
            on_point(point)
    return evaluations
