"""Where a key's search starts: from the shipped corpus's finalists, or from this run's cheaper keys.

**The corpus** (:func:`corpus_plans`): on a device of a kind the package holds a measured table for
(:mod:`attnbench.tables.corpus`), each key it tuned starts from its finalists; where this machine agrees
(:func:`attnbench.tuning.study.corpus_verdict`) the study stops there, else it is searched in full.

**This run's cheaper keys** (:func:`by_cost`, :func:`seeded_plan`): a grid's keys run cheapest first
(batch × context: a step at batch 8 × 32k tokens reads 256 times what one at batch 1 × 1k reads), the
first key of each dispatch map (same model, shape and dtype) searched as planned. A costlier key of
the same map then starts from the finalists of the two nearest keys already studied (in octaves of
batch and context, the nearest first), then its default and each backend's default, then Optuna's TPE sampler, which has
all of them in its history; it stops once ``patience`` candidates in a row have not beaten its best
by more than the switch margin (:func:`attnbench.tuning.study.converged`), or when the space is exhausted. The timed steps
are a study's as everywhere (gate first, pruned when clearly slower), and the finalists are re-timed
interleaved as after any study. The evidence that neighbouring keys' finalists hold a costlier key's
winner is the dispatch map's own (a map point between two tuned keys is answered by their finalists)
and is measured against the exhaustive search by ``scripts/regret.py --exhaustive``; ``tune
--no-transfer`` searches every key as planned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from attnbench.tables.table_schema import Candidate
from attnbench.tuning.study import KeyResult, StudyPlan

__all__ = ["by_cost", "corpus_plans", "seeded_plan"]


def by_cost(plans: Sequence[StudyPlan]) -> list[StudyPlan]:
    """``plans`` with each dispatch map's keys cheapest first (batch × context), the maps in their order."""
    groups: dict[tuple[str, str, str], int] = {}
    for p in plans:
        groups.setdefault(p.group, len(groups))
    return sorted(plans, key=lambda p: (groups[p.group], p.workload.batch * p.workload.context))


def seeded_plan(
    plan: StudyPlan,
    studied: Sequence[tuple[StudyPlan, KeyResult]],
    *,
    patience: int,
    finalists: int = 3,
    keys: int = 2,
) -> StudyPlan:
    """``plan`` started from the finalists of the ``keys`` nearest ``studied`` keys of its dispatch map
    (the fastest ``finalists`` of each by its study, the nearest key first), then searched until
    ``patience`` candidates in a row bring nothing better; ``plan`` itself where no key of its map was
    studied, or where the corpus already starts it. Farther keys' finalists are left to the search:
    at batch 8 × 32k each seed costs seconds, and the nearest keys are the ones that predict it."""
    if plan.corpus_first or patience <= 0:
        return plan
    mine = [(p, r) for p, r in studied if p.group == plan.group and p.key.row != plan.key.row]
    if not mine:
        return plan
    space = {c.ident(): c for c in plan.space.candidates()}
    mine.sort(key=lambda pr: _distance(pr[0], plan))
    mine = mine[:keys]
    seeds: list[Candidate] = []
    for _, result in mine:
        ok = sorted((r for r in result.records if r.ok and r.value), key=lambda r: r.value or 0)
        for r in ok[:finalists]:
            c = space.get(plan.space.canonical(r.candidate).ident())
            if c is not None and c not in seeds:
                seeds.append(c)
    if not seeds:
        return plan
    where = ", ".join(f"b={p.workload.batch} ctx={p.workload.context}" for p, _ in mine)
    return dataclasses.replace(
        plan, exhaustive=False, seeds=tuple(seeds), seeded_from=where, patience=patience
    )


def _distance(a: StudyPlan, b: StudyPlan) -> float:
    """How far two keys lie apart, in octaves of batch and of context."""
    return abs(math.log2(a.workload.batch / b.workload.batch)) + abs(
        math.log2(max(a.workload.context, 1) / max(b.workload.context, 1))
    )


def corpus_plans(
    plans: Sequence[StudyPlan], table: Any, label: str, *, finalists: int = 3
) -> list[StudyPlan]:
    """``plans`` with :attr:`StudyPlan.corpus_first` set where the corpus ``table`` (a
    :class:`~attnbench.tables.ResultsTable` of this device's hardware id) tuned the same key: its winner,
    then the next fastest up to ``finalists`` in all, then the default, then the corpus's finalists of
    the other keys of its dispatch map (same model and dtype), each where this plan's space holds it —
    so that each point's study has measured every candidate the map's points are re-timed with, and
    the map needs no second interleaved run of a point."""
    by_key = {
        (e.model, e.shape_hash, e.dtype, e.batch_bucket, e.context_bucket): e for e in table.typed().values()
    }
    out = [_corpus_plan(plan, by_key, label, finalists) for plan in plans]
    groups: dict[tuple[str, str, str], list[str]] = {}
    for plan in out:
        for c in plan.corpus_first[:finalists]:
            group = groups.setdefault(plan.group, [])
            if c.ident() not in group:
                group.append(c.ident())
    for i, plan in enumerate(out):
        if not plan.corpus_first:
            continue
        space = {c.ident(): c for c in plan.space.candidates()}
        mine = {c.ident() for c in plan.corpus_first}
        others = groups[plan.group]
        extra = tuple(space[x] for x in others if x in space and x not in mine)
        out[i] = dataclasses.replace(plan, corpus_first=plan.corpus_first + extra)
    return out


def _corpus_plan(
    plan: StudyPlan, by_key: dict[tuple[Any, ...], Any], label: str, finalists: int
) -> StudyPlan:
    """``plan`` with the corpus's winner, its next fastest and the default first (see :func:`corpus_plans`)."""
    k = plan.key
    entry = by_key.get((k.model, k.shape_hash, k.dtype, k.batch_bucket, k.context_bucket))
    if entry is None or entry.winner is None:
        return plan
    space = {c.ident(): c for c in plan.space.candidates()}
    measured = [c for c in entry.candidates if c.step_ms is not None and not c.failed]
    ranked = [entry.winner, *sorted(measured, key=lambda c: c.step_ms or 0)]
    firsts: list[Candidate] = []
    for c in ranked:  # each as this space holds it (a config that runs the same here: the same candidate)
        ident = plan.space.canonical(Candidate(c.backend, c.config)).ident()
        if ident in space and space[ident] not in firsts and len(firsts) < finalists:
            firsts.append(space[ident])
    winner = plan.space.canonical(Candidate(entry.winner.backend, entry.winner.config))
    if not firsts or firsts[0].ident() != winner.ident():
        return plan  # the corpus's winner is not in this space: nothing to confirm
    default = plan.space.candidates()[0]
    if default not in firsts:
        firsts.append(default)
    return dataclasses.replace(plan, corpus_first=tuple(firsts), corpus_label=label)
