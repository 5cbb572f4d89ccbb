"""The dispatch map's lookup: the part of ``select()`` that runs per call.

:meth:`attnbench.tables.dispatch.DispatchMap.lookup` finds the grid cell around (batch, context) and
hands it here. A :class:`Cell` holds what one cell needs, made once per cell and set of eligible
candidates: each candidate's logs at the four corners. Per call, :func:`answer` interpolates each
candidate's median (log-log bilinear), makes the intervals of the few that the one margin policy
(:func:`attnbench.tables.margin.decide`) compares (the fastest, the default, those that may beat
it), decides, and returns a :class:`Lookup`; every candidate's interval is made only when
:attr:`Lookup.predicted` is read. The medians and intervals are computed by the same expressions, so
the answer is the one deciding over every interval gives, to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Literal, NamedTuple

from attnbench.tables.margin import Interval, decide

if TYPE_CHECKING:
    from attnbench.tables.dispatch import GridPoint, MapCandidate

__all__ = ["Basis", "Cell", "Lookup", "answer", "make_cell"]

#: what a time from the map is (see :attr:`Lookup.basis`)
Basis = Literal["measured", "interpolated", "extrapolated"]


@dataclass(frozen=True)
class Lookup:
    """The map's answer for one (batch, context).

    ``label`` is the chosen candidate (``None`` when no candidate is measured at all four corners)
    and ``chosen`` its interpolated interval, ``cell`` the batch and context lines around the point
    ``(b0, b1, c0, c1)``, ``corners`` those four grid points and ``point`` the (batch, context)
    looked up. :attr:`predicted` holds every eligible candidate's interpolated interval; it is
    computed when first read (the decision needs the medians and a few intervals, ``select()`` asks
    per batch). :attr:`basis` says what the times are.
    """

    label: str | None
    candidate: MapCandidate | None
    tie: bool
    reason: str
    extrapolated: bool
    cell: tuple[int, int, int, int]
    corners: tuple[GridPoint, ...]
    point: tuple[int, int] | None = None
    chosen: Interval | None = None
    #: what the times are: ``"measured"`` (the point is a tuned grid point: its own measurements),
    #: ``"interpolated"`` (between the tuned points around it) or ``"extrapolated"`` (outside the
    #: tuned grid: the trend across it extended, a prediction)
    basis: Basis = "interpolated"
    #: makes :attr:`predicted` (called once, on its first read)
    interpolate: Callable[[], dict[str, Interval]] = field(default=dict, repr=False, compare=False)

    @cached_property
    def predicted(self) -> dict[str, Interval]:
        """Every eligible candidate's interpolated interval, by label (made on first read)."""
        return self.interpolate()

    def explain(self) -> str:
        b0, b1, c0, c1 = self.cell
        where = f"cell batch {b0}..{b1} × context {c0}..{c1}"
        basis = self.basis
        if basis == "extrapolated":
            where += " (extrapolated: outside the tuned region, the trend across it extended; predicted, not measured)"
        elif basis == "measured" and self.point is not None:
            where += f" (at the tuned point batch {self.point[0]}, context {self.point[1]})"
        lines = [f"dispatch map: {where}; {self.reason}"]
        said = {
            "measured": "measured at this point",
            "interpolated": "interpolated",
            "extrapolated": "extrapolated (predicted)",
        }
        for k, t in sorted(self.predicted.items(), key=lambda kv: kv[1].median_ms):
            lines.append(f"    {k}: {t} {said[basis]}")
        for p in self.corners:
            win = f"{p.winner}{' (tie)' if p.tie else ''}"
            load = f", load {p.load_avg[0]:.2g}" if p.load_avg else ""
            lines.append(f"    corner b={p.batch} ctx={p.context}: {win}{load}")
        return "\n".join(lines)


#: Lookup keeps its fields in its __dict__ (no slots), so :func:`answer` may fill them directly
_PLAIN_LOOKUP = "__slots__" not in vars(Lookup)

#: one candidate of a cell: label, log medians at the four corners, log distances from each median
#: down to its interval's low end and up to its high end, fewest samples, and whether every high end
#: lies at or above its median (then the interpolated high end does too)
Row = tuple[str, tuple[float, ...], tuple[float, ...], tuple[float, ...], int, bool]
Weights = tuple[float, float, float, float]
#: an eligible candidate of a lookup: its interpolated median (ms), its row and the corner weights
Median = tuple[float, Row, Weights]


class Cell(NamedTuple):
    """A grid cell of a map for one set of eligible candidates (see :func:`make_cell`)."""

    corners: tuple[GridPoint, ...]  # the measured corners, each once
    rows: tuple[Row, ...] | None  # None: a corner is not measured
    places: dict[str, int]  # label → place in rows
    #: at each of the four corners (the order of :func:`weights`), the eligible candidate with the
    #: lowest measured median there: the incumbent where the default is not eligible (:func:`answer`)
    fastest: tuple[str | None, ...] = (None, None, None, None)
    #: the four corners' (batch, context), in the same order
    keys: tuple[tuple[int, int], ...] = ()


def weights(wb: float, wc: float) -> Weights:
    """The four corners' bilinear weights for weights ``wb`` toward the upper batch line and ``wc``
    toward the upper context line (corners in the order (b0, c0), (b1, c0), (b0, c1), (b1, c1))."""
    return ((1 - wb) * (1 - wc), wb * (1 - wc), (1 - wb) * wc, wb * wc)


def interval(row: Row, w: Weights) -> Interval:
    """The row's interval at corner weights ``w`` (log-log bilinear; the bounds move with the weights'
    magnitudes, so extrapolating never narrows them)."""
    _, (m0, m1, m2, m3), (d0, d1, d2, d3), (u0, u1, u2, u3), n, _ = row
    w0, w1, w2, w3 = w
    a0, a1, a2, a3 = abs(w0), abs(w1), abs(w2), abs(w3)
    med = w0 * m0 + w1 * m1 + w2 * m2 + w3 * m3
    down = a0 * d0 + a1 * d1 + a2 * d2 + a3 * d3
    up = a0 * u0 + a1 * u1 + a2 * u2 + a3 * u3
    return Interval(math.exp(med), math.exp(med - down), math.exp(med + up), n)


def _medians(cells: Sequence[tuple[tuple[Row, ...] | None, float, float]]) -> dict[str, Median]:
    """Every row's interpolated median, by label, for cells ``(rows, batch weight, context weight)``:
    a later cell's value replaces an earlier one's in its place (as ``dict | dict``). The median is
    computed as :func:`interval` computes it, so the two agree to the bit."""
    exp = math.exp
    out: dict[str, Median] = {}
    for rows, wb, wc in cells:
        if rows is None:
            continue
        w = weights(wb, wc)
        w0, w1, w2, w3 = w
        for row in rows:
            m0, m1, m2, m3 = row[1]
            out[row[0]] = (exp(w0 * m0 + w1 * m1 + w2 * m2 + w3 * m3), row, w)
    return out


def _deciders_in(
    rows: tuple[Row, ...], places: dict[str, int], w: Weights, default: str | None, margin: float
) -> dict[str, Interval]:
    """The intervals :func:`~attnbench.tables.margin.decide` needs for the rows of one cell at
    weights ``w`` (``select()`` runs it per call): the fastest, the default, and of the candidates
    that beat the default by the margin only the one ``decide`` would pick — its verdict from these
    is the verdict from every row's interval. The medians are computed as :func:`interval` computes
    them, so the two agree to the bit."""
    exp = math.exp
    w0, w1, w2, w3 = w
    at = places[default] if default is not None else -1  # the default's row
    d = interval(rows[at], w) if at >= 0 else None
    reach = -math.inf  # a median above this cannot beat the default (slack for rounding)
    if d is not None:
        reach = d.lo_ms / (1 + margin) * (1 + 1e-9) if margin > -1 else math.inf
    fastest, best = -1, math.inf
    maybe: list[tuple[float, int]] = []  # rows whose median does not rule out beating the default
    for i, row in enumerate(rows):
        m0, m1, m2, m3 = row[1]
        med = exp(w0 * m0 + w1 * m1 + w2 * m2 + w3 * m3)
        if med < best or fastest < 0:
            fastest, best = i, med
        if i != at and (med <= reach or not row[5]):
            maybe.append((med, i))
    if fastest < 0:
        return {}
    if d is None:
        return {rows[fastest][0]: interval(rows[fastest], w)}
    # decide() takes, of the candidates that beat the default, the lowest median (the first in row
    # order among equal ones): scanning them by (median, row), the first that beats it is that one and
    # the rest cannot change the verdict — no interval is made for them
    scale = 1 + margin
    made: dict[int, Interval] = {}
    maybe.sort()
    for _, i in maybe:
        t = interval(rows[i], w)
        if d.lo_ms >= scale * t.hi_ms:
            made[i] = t
            break
    if fastest != at and fastest not in made:
        made[fastest] = interval(rows[fastest], w)
    return {rows[i][0]: d if i == at else made[i] for i in sorted({at, *made})}


def _deciders(medians: dict[str, Median], default: str | None, margin: float) -> dict[str, Interval]:
    """The intervals :func:`~attnbench.tables.margin.decide` needs, in ``medians``' order: the fastest
    (the first of the lowest medians), the default, and of the candidates that beat it by the margin
    (``default.lo ≥ (1 + margin) · challenger.hi``) the one ``decide`` picks (the lowest median, the
    first in order among equal ones). ``decide`` of these gives the verdict ``decide`` of every
    candidate gives; a candidate whose median alone rules it out (a high end is never below its
    median) gets no interval made."""
    fastest = min(medians, key=lambda k: medians[k][0], default=None)  # the first of the lowest
    if fastest is None:
        return {}
    if default is None:
        return {fastest: interval(*medians[fastest][1:])}
    d = interval(*medians[default][1:])
    scale = 1 + margin
    reach = d.lo_ms / scale * (1 + 1e-9) if scale > 0 else math.inf  # see _deciders_in
    order = {k: pos for pos, k in enumerate(medians)}
    maybe = sorted(
        (med, order[k], k)
        for k, (med, row, _) in medians.items()
        if k != default and (med <= reach or not row[5])
    )
    made: dict[str, Interval] = {}
    for _, _, k in maybe:  # the lowest median that beats the default (see _deciders_in)
        t = interval(*medians[k][1:])
        if d.lo_ms >= scale * t.hi_ms:
            made[k] = t
            break
    if fastest != default and fastest not in made:
        made[fastest] = interval(*medians[fastest][1:])
    return {k: d if k == default else made[k] for k in medians if k == default or k in made}


def make_cell(
    corners: tuple[GridPoint, ...],
    logs: Sequence[Mapping[str, tuple[float, float, float, int]] | None],
    labels: Iterable[str],
    keys: tuple[tuple[int, int], ...] = (),
) -> Cell:
    """The cell of the measured ``corners`` (each once) whose four corner points have the times
    ``logs`` (by label: log median, log low end, log high end, samples; ``None`` for a corner not
    measured): one row per label of ``labels`` measured at all four corners, in that order."""
    measured = [t for t in logs if t is not None]
    if len(measured) < 4:
        return Cell(corners, None, {}, keys=keys)
    l0, l1, l2, l3 = measured
    rows: list[Row] = []
    for label in labels:
        t0, t1, t2, t3 = l0.get(label), l1.get(label), l2.get(label), l3.get(label)
        if t0 is None or t1 is None or t2 is None or t3 is None:
            continue
        up = (t0[2] - t0[0], t1[2] - t1[0], t2[2] - t2[0], t3[2] - t3[0])
        rows.append(
            (
                label,
                (t0[0], t1[0], t2[0], t3[0]),
                (t0[0] - t0[1], t1[0] - t1[1], t2[0] - t2[1], t3[0] - t3[1]),
                up,
                min(1 << 30, t0[3], t1[3], t2[3], t3[3]),
                min(up) >= 0,
            )
        )
    fastest = tuple(min(rows, key=lambda r: r[1][j])[0] if rows else None for j in range(4))
    return Cell(corners, tuple(rows), {r[0]: i for i, r in enumerate(rows)}, fastest, keys)


def _incumbent(cell: Cell, wb: float, wc: float) -> tuple[str | None, str]:
    """The candidate that a challenger must beat where the default is not eligible in ``cell``: the
    fastest measured at the corner nearest the point (weights ``wb``, ``wc``, rounded; outside the
    grid, the corner on the point's side), and the words that name it in the reason."""
    j = (wb >= 0.5) + 2 * (wc >= 0.5)
    b, c = cell.keys[j] if cell.keys else ("?", "?")
    return cell.fastest[j], f"the fastest at the nearest tuned point (b={b}, ctx={c})"


def answer(
    cell: Cell,
    wb: float,
    wc: float,
    *,
    edge: tuple[Cell, float, float] | None,
    candidates: Mapping[str, MapCandidate],
    default: str | None,
    margin: float,
    lines: tuple[int, int, int, int],
    point: tuple[int, int],
    extrapolated: bool,
) -> Lookup:
    """The map's answer at ``point`` from ``cell`` at weights ``wb`` (toward its upper batch line)
    and ``wc`` (toward its upper context line); ``edge``, when given, is the edge cell and its
    weights, whose times count where the cell has none (as ``edge | cell``). ``lines`` are the cell's
    batch and context lines as the :class:`Lookup` reports them."""
    role = "the default"
    if edge is None:  # one cell: its rows in one pass
        rows = cell.rows or ()
        w = weights(wb, wc)
        if default not in cell.places:
            default, role = _incumbent(cell, wb, wc) if rows else (None, role)
        deciders = _deciders_in(rows, cell.places, w, default, margin)

        def interpolate() -> dict[str, Interval]:
            return {row[0]: interval(row, w) for row in rows}

    else:
        medians = _medians([(edge[0].rows, edge[1], edge[2]), (cell.rows, wb, wc)])
        if default not in medians:  # the incumbent: from the cell, or the edge cell where it has none
            near = _incumbent(cell, wb, wc) if cell.rows else _incumbent(*edge)
            default, role = (near[0], near[1]) if near[0] in medians else (None, role)
        deciders = _deciders(medians, default, margin)

        def interpolate() -> dict[str, Interval]:
            return {k: interval(row, w) for k, (_, row, w) in medians.items()}

    verdict = decide(deciders, default=default, margin=margin, role=role)
    label = verdict.winner
    on_lines = wb in (0.0, 1.0) and wc in (0.0, 1.0)  # a batch line and a context line: a grid point
    found = dict(
        label=label,
        candidate=candidates.get(label) if label else None,
        tie=verdict.tie,
        reason=verdict.reason,
        extrapolated=extrapolated,
        cell=lines,
        corners=cell.corners,
        point=point,
        chosen=deciders.get(label) if label else None,
        basis="extrapolated" if extrapolated else "measured" if on_lines else "interpolated",
        interpolate=interpolate,
    )
    if not _PLAIN_LOOKUP:
        return Lookup(**found)  # type: ignore[arg-type]  # found holds each field with its own type
    made = object.__new__(Lookup)  # the frozen __init__ sets each field through a check: skipped
    made.__dict__.update(found)
    return made
