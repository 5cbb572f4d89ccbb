"""Times with confidence intervals, and the one margin policy that decides between candidates.

Every time the tuner keeps is an :class:`Interval`: the median of its samples with a seeded bootstrap
confidence interval of that median. :func:`decide` is the single rule used by ``tune`` (the winner of
a table entry and of every point of a dispatch map), by the dispatch map's lookup (which
``select()`` calls) and by ``scripts/regret.py``:

    a challenger replaces the default only when it is faster by the switch margin *beyond the
    intervals*: ``default.lo ≥ (1 + margin) · challenger.hi``. Otherwise the result is a tie and the
    default is kept (a tie is recorded, never hidden).

So a candidate that is faster only by noise (its interval overlaps the default's widened by the
margin) never wins, and one that is genuinely faster wins whatever the machine's load did, as long as
the samples were taken interleaved (a load change hits every candidate alike).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "NEAR_ENOUGH",
    "SWITCH_MARGIN",
    "Interval",
    "Verdict",
    "bootstrap_median",
    "contending",
    "decide",
    "finalists",
    "in_doubt",
    "median_time",
    "sample_rounds",
    "too_wide",
    "undecided",
]

#: A challenger replaces the default only when faster by this much beyond the intervals (5 %).
SWITCH_MARGIN = 0.05
#: Relative half-width of the median's interval above which a run cannot decide anything.
WIDE = 0.25


class Interval(NamedTuple):
    """A time in milliseconds: the median and a confidence interval ``[lo, hi]`` of that median.

    A named tuple, so that the dispatch map's lookup can make many of them cheaply.
    """

    median_ms: float
    lo_ms: float
    hi_ms: float
    samples: int = 1

    @classmethod
    def exact(cls, ms: float) -> Interval:
        """A single time with no spread known (e.g. an entry written before intervals existed)."""
        return cls(ms, ms, ms, 1)

    @property
    def half_width(self) -> float:
        """Relative half-width ``(hi - lo) / 2 / median``."""
        return (self.hi_ms - self.lo_ms) / 2 / self.median_ms if self.median_ms > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {
            "median_ms": round(self.median_ms, 5),
            "lo_ms": round(self.lo_ms, 5),
            "hi_ms": round(self.hi_ms, 5),
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Interval:
        med = float(data["median_ms"])
        return cls(
            med, float(data.get("lo_ms", med)), float(data.get("hi_ms", med)), int(data.get("samples", 1))
        )

    def __str__(self) -> str:
        return f"{self.median_ms:.4g} ms [{self.lo_ms:.4g}, {self.hi_ms:.4g}]"


def bootstrap_median(
    samples_ms: Sequence[float | Sequence[float]],
    *,
    seed: int = 0,
    resamples: int = 1000,
    level: float = 0.95,
) -> Interval:
    """The median of ``samples_ms`` with a percentile-bootstrap ``level`` interval (seeded).

    A sample may be a row: one time per model instance, all taken in one round. The time is then the
    median over the instances of each instance's median over the rounds (:func:`median_time`), and the
    bootstrap draws whole rounds. So a candidate is timed over its placements (one placement's
    luck does not decide it) and each instance's series is as robust to a load spike as one instance's
    (a round's median over four instances is moved by two spikes, and over two instances by one).
    A row with a non-finite time is dropped whole."""
    rows = _rows(samples_ms)
    everything = range(len(rows))
    med = _median_of_instances(rows, everything)
    if len(rows) == 1:
        return Interval(med, med, med, 1)
    rng = random.Random(seed)
    n = len(rows)
    meds = sorted(_median_of_instances(rows, rng.choices(everything, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    lo = meds[int(tail * (resamples - 1))]
    hi = meds[math.ceil((1 - tail) * (resamples - 1))]
    return Interval(med, min(lo, med), max(hi, med), n)


def median_time(samples_ms: Sequence[float | Sequence[float]]) -> float:
    """The time :func:`bootstrap_median` gives ``samples_ms`` (its median, without the interval): of
    rows, the median over the instances of each one's median."""
    rows = _rows(samples_ms)
    return _median_of_instances(rows, range(len(rows)))


def _rows(samples_ms: Sequence[float | Sequence[float]]) -> list[tuple[float, ...]]:
    """Every sample as a row of times (a single time: a row of one), those with a non-finite time left
    out; all rows of one width."""
    rows = [r for r in (_row(s) for s in samples_ms) if r is not None]
    if not rows:
        raise ValueError("bootstrap_median needs at least one finite sample")
    widths = sorted({len(r) for r in rows})
    if len(widths) > 1:
        raise ValueError(
            f"samples of {widths[0]} and of {widths[-1]} instances' times mixed: every round of one "
            "candidate times each of its instances once (rows of one width)"
        )
    return rows


def _row(sample: float | Sequence[float]) -> tuple[float, ...] | None:
    row = (float(sample),) if isinstance(sample, (int, float)) else tuple(float(x) for x in sample)
    return row if row and all(math.isfinite(x) for x in row) else None


def _median_of_instances(rows: Sequence[Sequence[float]], rounds: Sequence[int]) -> float:
    """The median over the instances (columns of ``rows``) of each one's median over ``rounds``."""
    if len(rows[0]) == 1:
        return statistics.median([rows[i][0] for i in rounds])
    return statistics.median([statistics.median([rows[i][c] for i in rounds]) for c in range(len(rows[0]))])


@dataclass(frozen=True)
class Verdict:
    """What :func:`decide` chose: ``winner`` (a label), whether it was a ``tie`` kept on the default (or
    on the incumbent a caller named in its place: ``decide``'s ``role``)."""

    winner: str | None
    tie: bool
    reason: str
    fastest: str | None = None  # the lowest median, whether or not it won
    gain: float | None = None  # default median / winner (or fastest) median - 1

    def as_dict(self) -> dict[str, Any]:
        return {"winner": self.winner, "tie": self.tie, "reason": self.reason, "fastest": self.fastest}


def beats(challenger: Interval, default: Interval, *, margin: float = SWITCH_MARGIN) -> bool:
    """``challenger`` is faster than ``default`` by ``margin`` beyond both intervals."""
    return default.lo_ms >= (1 + margin) * challenger.hi_ms


def _gain(default: Interval, other: Interval) -> float:
    """How much faster ``other`` is than ``default`` by the medians (inf when ``other`` took no time)."""
    return default.median_ms / other.median_ms - 1 if other.median_ms > 0 else math.inf


def decide(
    times: Mapping[str, Interval],
    *,
    default: str | None,
    margin: float = SWITCH_MARGIN,
    role: str = "the default",
) -> Verdict:
    """The one margin policy (see the module docstring).

    ``times`` maps candidate labels to their intervals (failed candidates are simply absent).
    Without a measured default, the fastest median wins. ``role`` names the incumbent in the reason:
    the dispatch map's lookup passes the fastest candidate of the nearest tuned point where the
    default has no time there (:func:`attnbench.tables.lookup.answer`).
    """
    if not times:
        return Verdict(None, False, "no candidate was measured")
    fastest = min(times, key=lambda k: times[k].median_ms)
    if default is None or default not in times:
        why = "fastest correct candidate" + ("" if default is None else f"; {role} {default} has no time")
        return Verdict(fastest, False, why, fastest)
    d = times[default]
    if fastest == default:
        why = (
            "the default is the fastest"
            if role == "the default"
            else f"{role}, {default}, is the fastest here too"
        )
        return Verdict(default, False, why, fastest, 0.0)
    winners = [k for k in times if k != default and beats(times[k], d, margin=margin)]
    if winners:
        best = min(winners, key=lambda k: times[k].median_ms)
        gain = _gain(d, times[best])
        by = "took no measurable time, against" if math.isinf(gain) else f"{gain:.1%} faster than"
        why = f"{by} {role} {default} (beyond the intervals by more than the {margin:.0%} switch margin)"
        return Verdict(best, False, why, fastest, gain)
    gain = _gain(d, times[fastest])
    why = (
        f"tie: kept {role} {default}; {fastest} is only {gain:.1%} faster by the medians, not "
        f"{margin:.0%} beyond the intervals ({times[fastest]} vs {d})"
    )
    return Verdict(default, True, why, fastest, gain)


#: a candidate further behind the best than this multiple of its time has no tie to decide: it is no
#: finalist to make three (:func:`finalists`), and a tuner re-times the default only within it
NEAR_ENOUGH = 2.0


def finalists(
    times: Mapping[str, Interval],
    *,
    minimum: int = 3,
    maximum: int = 8,
    keep: Sequence[str] = (),
    within: float = NEAR_ENOUGH,
) -> list[str]:
    """Candidates to re-time: every one within two confidence intervals of the best, at least
    ``minimum`` and at most ``maximum`` (the fastest ones by median: they are all held in memory at
    once), plus ``keep`` (the default, an incumbent) when measured. The next fastest are added up to
    ``minimum`` only where their interval reaches within ``within`` × the best's median (a noisy study
    time is not held against them): one further behind has no tie to decide, and re-timing it costs
    the most (a study whose others were pruned once offered the default at batch 8 × 8k tokens, 35 ×
    the best's step, as its third finalist, and every key of its dispatch map re-timed it)."""
    if not times:
        return []
    order = sorted(times, key=lambda k: times[k].median_ms)
    best = times[order[0]]
    reach = best.hi_ms + 2 * (best.hi_ms - best.lo_ms)
    out = [k for k in order if times[k].lo_ms <= reach or times[k].median_ms <= best.median_ms * 1.05]
    out = out[:maximum]
    near = [k for k in order if k not in out and times[k].lo_ms <= within * best.median_ms]
    out += near[: max(0, minimum - len(out))]  # the next fastest, to minimum
    out += [k for k in keep if k in times and k not in out]
    return out


def too_wide(times: Mapping[str, Interval], *, limit: float = WIDE) -> list[str]:
    """Labels whose interval is too wide (relative half-width above ``limit``) to decide anything."""
    return [k for k, t in times.items() if t.half_width > limit]


def in_doubt(times: Mapping[str, Interval], *, margin: float = SWITCH_MARGIN) -> list[str]:
    """Labels whose interval reaches down to within ``margin`` of the best's (their low end at or under
    its high end × (1 + margin)): the candidates that could still be the fastest or tie with it. The
    others lie wholly above that: slower, by their intervals, by more than a switch is decided on."""
    if not times:
        return []
    best = min(times.values(), key=lambda t: t.median_ms)
    return [k for k, t in times.items() if t.lo_ms <= best.hi_ms * (1 + margin)]


def contending(
    times: Mapping[str, Interval], *, protect: Collection[str] = (), margin: float = SWITCH_MARGIN
) -> list[str]:
    """Labels that more samples could still matter for: those whose interval overlaps the best's
    (their low end at or under its high end: they could be the fastest), and those of ``protect`` (the
    default, an incumbent: :func:`decide` keeps one against a challenger that does not beat it by the
    margin beyond both intervals) that are :func:`in_doubt`. A candidate wholly slower than the best's
    interval cannot be the answer, and its median, though known less closely, still ranks it."""
    if not times:
        return []
    best = min(times.values(), key=lambda t: t.median_ms)
    reach = {k: best.hi_ms * (1 + margin) if k in protect else best.hi_ms for k in times}
    return [k for k, t in times.items() if t.lo_ms <= reach[k]]


def undecided(times: Mapping[str, Interval], *, margin: float = SWITCH_MARGIN) -> list[str]:
    """Labels whose median is more than twice ``margin`` behind the best's while their interval still
    reaches the best's within ``margin`` (:func:`beats` does not hold): more samples can still decide
    between them and the best. Where the medians are closer there is no switch to decide; where the
    intervals are apart it is decided. (A candidate 30 % faster whose steps a load slows 3× one time in
    five can end 15 samples with an interval just under :data:`WIDE` that still reaches the other's.)"""
    if not times:
        return []
    best = min(times.values(), key=lambda t: t.median_ms)
    return [
        k
        for k, t in times.items()
        if t.median_ms > (1 + 2 * margin) * best.median_ms and not beats(best, t, margin=margin)
    ]


def sample_rounds(
    run_round: Callable[[int, Sequence[str] | None], Mapping[str, float | Sequence[float]]],
    *,
    samples: int = 15,
    max_samples: int | None = None,
    seed: int = 0,
    first: int | None = None,
    max_seconds: float | None = None,
    protect: Collection[str] = (),
) -> dict[str, list[float | Sequence[float]]]:
    """Interleaved samples: ``run_round(r, labels)`` times one step of each of ``labels`` (``None``:
    every candidate), in an order of its choosing, and returns ``{label: ms}`` (or ``{label: [ms, …]}``,
    one step of each of the candidate's model instances: :func:`bootstrap_median`).

    Rounds run in blocks of ``first`` (default a third of ``samples``, at least 3), every candidate
    in the first. Before each later block the candidates are sorted by their intervals: one whose
    interval lies wholly above the best's (:func:`contending`; for one of ``protect``, the default or
    an incumbent, above it by more than the switch margin, :func:`in_doubt`, as :func:`decide` needs
    it) stops being timed — it keeps its samples and its interval, which already say it is slower —
    and the block goes to those still in doubt; one that the best's interval has since moved up to
    meet is timed again. Blocks run until every
    candidate in doubt has ``samples`` samples, none of their intervals is too wide to decide
    (:func:`too_wide`) and none whose median is apart from the best's is still undecided
    (:func:`undecided`), up to ``max_samples`` (default ``4 × samples``): a candidate whose steps are
    often slowed by the load then gets enough samples for its median to be known, instead of a tie
    by noise, and a clearly slower one (the default, often several times slower) costs a few steps.
    ``max_seconds``: no block starts once the blocks so far took that long (the first always runs): at
    long context a round of ten finalists takes ten seconds, and their intervals are narrow by then."""
    cap = max_samples if max_samples is not None else 4 * samples
    start = time.perf_counter()
    block = max(3, samples // 3) if first is None else max(1, first)
    out: dict[str, list[float | Sequence[float]]] = {}
    labels: list[str] | None = None
    r = 0
    while True:
        for _ in range(block):
            for label, ms in run_round(r, labels).items():
                out.setdefault(label, []).append(ms)
            r += 1
        times = {k: bootstrap_median(v, seed=seed) for k, v in out.items() if v}
        labels = contending(times, protect=protect)
        most = max((len(out[k]) for k in labels), default=cap)
        short = any(len(out[k]) < samples for k in labels)
        doubt = {k: times[k] for k in labels}
        if not (short or too_wide(doubt) or undecided(doubt)) or most + block > cap:
            return out
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            return out
