"""Latency of ``attnbench.select()`` as serving code calls it: once per batch, keyword form.

For each source of an answer — the roofline heuristic (an empty results folder), a dispatch map (a
planted map over a batch × context grid: the lookup's cost does not depend on the times in it), both
with the shipped corpus switched off (``ATTNBENCH_CORPUS=off``, else it would answer them), the shipped
corpus's map where it holds this kind of machine (the empty folder with the corpus on), and,
with ``--results DIR``, whatever that results folder holds (e.g. what ``attnbench tune`` wrote: its map
has many candidates per point) — a fresh :class:`attnbench.selection.select.Selector` is made, its first call is
timed (registry, model shape, device fingerprint, table and map read), then ``--calls`` further calls,
each with a (batch, context) pair not used before, are timed one by one with ``time.perf_counter_ns``.
Reported: the first call, and the median, p90, p99 and mean of the later ones. The planted folders are
dated a minute back, as a folder ``tune`` wrote before a server started is: ``select()`` then checks
it for a rewrite with one ``os.stat`` per call (in the two seconds after a folder changes it also
``os.stat``-s the files in it; see :class:`attnbench.selection.select.Selector`). For ``--results`` the
report describes the map it read (grid lines, points, candidates per point) and adds a row of calls
inside the map's tuned grid (interpolated between its points rather than extrapolated beyond them).

    python scripts/select_latency.py                   # 10,000 calls per source (about 1 minute)
    python scripts/select_latency.py --quick --out sl-smoke   # a smoke test (200 calls)
    python scripts/select_latency.py --results DIR --out PREFIX   # also the tables `tune` wrote in DIR

Runs from any directory. Writes the repository's ``results/cpu/select/select-latency.json`` and ``.md``
(``--out PREFIX`` elsewhere, relative to the current directory) with the command, the machine, the
date and the load average before and after. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import torch

from attnbench.core.device import fingerprint
from attnbench.core.shapes import load_shape
from attnbench.core.workload import bucket
from attnbench.selection.select import Selector
from attnbench.tables.corpus import CORPUS_ENV, corpus_entry
from attnbench.tables.dispatch import (
    DispatchMap,
    GridPoint,
    MapCandidate,
    dispatch_path,
    load_maps,
    map_key,
    save_maps,
)
from attnbench.tables.margin import Interval
from attnbench.tables.table import ResultsTable, hardware_id, table_path

#: the repository's results folder (the default --out), wherever the script is run from
RESULTS = Path(__file__).resolve().parents[1] / "results"


def _planted_map(folder: Path, *, model: str, dtype: str, device: str) -> Path:
    """A dispatch map over batch 1..256 × context 256..128k with three candidates whose planted times
    cross, so lookups land in every kind of cell (the lookup reads the times, never measures)."""
    shape = load_shape(model)
    fp = fingerprint(device)
    batches, contexts = [1, 4, 16, 64, 256], [256, 1024, 4096, 16384, 65536, 131072]
    candidates = {
        "flash": MapCandidate("flash", {}),
        "naive": MapCandidate("naive", {}),
        "triton_paged[page_size=64]": MapCandidate("triton_paged", {"page_size": 64}),
    }
    points = {}
    for b in batches:
        for c in contexts:
            base = 1e-4 * b * c
            times = {
                "flash": Interval(base, base * 0.97, base * 1.03, 15),
                "naive": Interval(base * (0.8 if b < 8 else 1.3), base * 0.78, base * 1.35, 15),
                "triton_paged[page_size=64]": Interval(base * 1.1, base * 1.05, base * 1.15, 15),
            }
            points[(b, c)] = GridPoint(b, c, times, winner="flash")
    m = DispatchMap(model, shape.fingerprint(), dtype, "flash", batches, contexts, candidates, points)
    path = dispatch_path(table_path(folder, fp))
    save_maps(path, [m], device={"hardware_id": hardware_id(fp)})
    return path


def _pairs(
    n: int, *, seed: int, batches: tuple[int, int] = (1, 256), contexts: tuple[int, int] = (1, 131072)
) -> list[tuple[int, int]]:
    """``n`` distinct (batch, context) pairs, log-uniform over ``batches`` × ``contexts`` (inclusive;
    fewer when the ranges hold fewer pairs)."""
    rng = random.Random(seed)
    (b0, b1), (c0, c1) = batches, contexts
    n = min(n, (b1 - b0 + 1) * (c1 - c0 + 1))
    lb0, lb1, lc0, lc1 = math.log2(b0), math.log2(b1 + 1), math.log2(c0), math.log2(c1 + 1)
    seen: set[tuple[int, int]] = set()
    while len(seen) < n:
        b = min(b1, int(2 ** rng.uniform(lb0, lb1)))
        c = min(c1, int(2 ** rng.uniform(lc0, lc1)))
        seen.add((b, c))
    out = list(seen)
    rng.shuffle(out)
    return out


def _stats(times: list[float]) -> dict:
    times = sorted(times)
    if not times:
        return {"calls": 0}
    return {
        "calls": len(times),
        "median_us": round(statistics.median(times), 2),
        "p90_us": round(times[int(0.9 * len(times))], 2),
        "p99_us": round(times[int(0.99 * len(times))], 2),
        "mean_us": round(statistics.fmean(times), 2),
    }


def _measure(
    folder: Path,
    *,
    model: str,
    dtype: str,
    device: str,
    calls: int,
    seed: int,
    within: tuple[tuple[int, int], tuple[int, int]] | None = None,
) -> dict:
    """The first call, then ``calls`` calls with fresh (batch, context) pairs (inside ``within``'s
    batch and context ranges when given). A pair in a batch × context bucket the selector has not seen
    asks each backend's ``resolve()`` once (its answer holds for the bucket), so those calls are also
    reported on their own."""
    selector = Selector()
    ranges = {} if within is None else {"batches": within[0], "contexts": within[1]}
    pairs = _pairs(calls + 1, seed=seed, **ranges)
    b, c = pairs[0]
    t0 = time.perf_counter_ns()
    first = selector.select(model=model, batch=b, context=c, dtype=dtype, device=device, results_dir=folder)
    first_us = (time.perf_counter_ns() - t0) / 1e3
    seen = {(bucket(b), bucket(c))}
    times: list[float] = []
    in_seen: list[float] = []
    in_new: list[float] = []
    sources = set()
    answered = {"dispatch map": 0, "table entry": 0}  # of the tuned answers
    for b, c in pairs[1:]:
        new = (bucket(b), bucket(c)) not in seen
        t0 = time.perf_counter_ns()
        choice = selector.select(
            model=model, batch=b, context=c, dtype=dtype, device=device, results_dir=folder
        )
        dt = (time.perf_counter_ns() - t0) / 1e3
        times.append(dt)
        (in_new if new else in_seen).append(dt)
        seen.add((bucket(b), bucket(c)))
        sources.add(choice.source)
        if choice.source == "tuned":
            answered["dispatch map" if choice.lookup is not None else "table entry"] += 1
    return {
        "first_call_us": round(first_us, 1),
        "first_source": first.source,
        **_stats(times),
        "seen_bucket": _stats(in_seen),
        "new_bucket": _stats(in_new),
        "sources": sorted(sources),
        "tuned_from": answered,
    }


def _describe(folder: Path, *, model: str, dtype: str, device: str) -> dict:
    """What ``folder`` holds for ``model`` and ``dtype`` on this device: the dispatch map's grid (its
    lines, points, candidates and candidates measured per point) and the table's entries."""
    fp = fingerprint(device)
    shape = load_shape(model)
    tpath = table_path(folder, fp)
    out: dict = {"table": tpath.name if tpath.exists() else None, "map": None, "entries": 0}
    try:
        maps = load_maps(dispatch_path(tpath), hardware_id=hardware_id(fp))
    except ValueError as err:
        out["map_error"] = str(err)
        maps = {}
    m = maps.get(map_key(shape.name, shape.fingerprint(), dtype))
    if m is not None:
        per_point = sorted(len(p.times) for p in m.points.values()) or [0]
        out["map"] = {
            "name": dispatch_path(tpath).name,
            "batches": m.batches,
            "contexts": m.contexts,
            "points": len(m.points),
            "candidates": len(m.candidates),
            "candidates_per_point": [per_point[0], statistics.median(per_point), per_point[-1]],
        }
    if tpath.exists():
        entries = [
            e
            for e in ResultsTable.load(tpath, fingerprint=fp).typed().values()
            if e.model == shape.name and e.dtype == dtype
        ]
        out["entries"] = len(entries)
        out["candidates_per_entry"] = sorted(len(e.candidates) for e in entries)
    return out


def _held(d: dict) -> str:
    """One line on what a results folder held (see :func:`_describe`)."""
    m = d["map"]
    if m is None:
        held = "no dispatch map for this model and dtype" + (
            f" ({d['map_error']})" if "map_error" in d else ""
        )
    else:
        lo, mid, hi = m["candidates_per_point"]
        held = (
            f"dispatch map {len(m['batches'])} × {len(m['contexts'])} grid (batches {m['batches']}, "
            f"contexts {m['contexts']}), {m['points']} points, {m['candidates']} candidates, "
            f"{lo}–{hi} measured per point (median {mid:g})"
        )
    return f"{held}; table: {d['entries']} entries" + (
        f" with {min(d['candidates_per_entry'])}–{max(d['candidates_per_entry'])} candidates"
        if d.get("candidates_per_entry")
        else ""
    )


def _command(argv: list[str]) -> str:
    """The command line as the report records it: the folders given are the machine's own, so
    ``--results`` reads ``DIR`` (the report describes what it held) and ``--out`` its last part."""

    def shown(opt: str, value: str) -> str:
        return "DIR" if opt == "--results" else Path(value).name

    out: list[str] = []
    pending = ""  # the option whose value is the next argument
    for a in argv:
        opt, eq, value = a.partition("=")
        if pending:
            out.append(shown(pending, a))
            pending = ""
        elif opt in ("--results", "--out"):
            out.append(f"{opt}={shown(opt, value)}" if eq else a)
            pending = "" if eq else opt
        else:
            out.append(a)
    return "python scripts/select_latency.py" + "".join(f" {shlex.quote(a)}" for a in out)


def _answered(row: dict) -> str:
    """The sources of a row's answers, with how many tuned ones the map and the table gave."""
    out = []
    for source in row["sources"]:
        if source == "tuned":
            parts = [f"{k} {v}" for k, v in row["tuned_from"].items() if v]
            source += f" ({', '.join(parts)})" if parts else ""
        out.append(source)
    return ", ".join(out)


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """``$name`` set to ``value`` (``None``: left as it is) for the block, restored afterwards."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="auto")
    p.add_argument("--calls", type=int, default=10_000, help="timed calls after the first (default 10000)")
    p.add_argument("--quick", action="store_true", help="200 calls: a smoke test, not a measurement")
    p.add_argument("--results", metavar="DIR", help="also measure against this results folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plugins",
        action="store_true",
        help="load plugin backends too (default: built-ins only; a plugin is first asked in a child "
        "process per new bucket, which is then cached on disk)",
    )
    p.add_argument(
        "--out", metavar="PREFIX", help="write PREFIX.json/.md (default results/cpu/select/select-latency)"
    )
    args = p.parse_args(argv)
    calls = 200 if args.quick else args.calls
    if calls < 1:
        p.error(f"--calls {calls} must be ≥ 1")
    if args.results and not Path(args.results).is_dir():
        p.error(
            f"--results {args.results!r} is not a folder; accepted: a results folder `attnbench tune` wrote"
        )
    device = (
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )
    load_start = os.getloadavg()
    rows = {}
    plugins = _env("ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD", None if args.plugins else "1")  # built-ins only
    with tempfile.TemporaryDirectory() as tmp, plugins:
        empty, mapped = Path(tmp) / "empty", Path(tmp) / "map"
        empty.mkdir()
        _planted_map(mapped, model=args.model, dtype=args.dtype, device=device)
        for folder in (empty, mapped):  # written a minute ago, as a folder `tune` wrote before serving
            os.utime(folder, (time.time() - 60, time.time() - 60))
        common = {
            "model": args.model,
            "dtype": args.dtype,
            "device": device,
            "calls": calls,
            "seed": args.seed,
        }
        with _env(CORPUS_ENV, "off"):  # these rows measure their own source, not the shipped corpus
            rows["heuristic (empty results folder)"] = _measure(empty, **common)
            rows["dispatch map (planted 5×6 grid, 3 candidates)"] = _measure(mapped, **common)
        known = corpus_entry(hardware_id(fingerprint(device)))
        if known is not None:  # a kind of machine the project measured: select() before any tune
            with _env(CORPUS_ENV, "on"):
                rows[f"shipped corpus (empty results folder; {known.label})"] = _measure(empty, **common)
        held = None
        if args.results:
            folder = Path(args.results)
            held = _describe(folder, model=args.model, dtype=args.dtype, device=device)
            rows["results folder (--results)"] = _measure(folder, **common)
            if held["map"] is not None:  # and inside its tuned grid: interpolated, not extrapolated
                m = held["map"]
                within = ((m["batches"][0], m["batches"][-1]), (m["contexts"][0], m["contexts"][-1]))
                rows["results folder (--results), inside its tuned grid"] = _measure(
                    folder, **common, within=within
                )
    fp = fingerprint(device)
    report = {
        "command": _command(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "device": fp.get("name"),
            "kind": fp.get("kind"),
            "threads": fp.get("threads"),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": str(torch.__version__),
        },
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "quick": args.quick,
        "plugins": args.plugins,
        "target": "median ≤ 50 µs for (batch, context) values never seen before",
        "results_folder": held,
        "rows": rows,
    }
    prefix = Path(args.out) if args.out else RESULTS / "cpu" / "select" / "select-latency"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# select() latency",
        "",
        f"`{report['command']}` · {report['date']} · {fp.get('name')} ({os.cpu_count()} CPUs, {fp.get('threads')} "
        f"torch threads) · load average {load_start[0]:.2f} → {report['load_avg_end'][0]:.2f}"
        + (" · **--quick: a smoke test, not a measurement**" if args.quick else ""),
        "",
        "| source | first call µs | calls | median µs | p90 µs | p99 µs | mean µs "
        "| seen bucket: calls, median µs | new bucket: calls, median µs | answered from |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        seen, new = r["seen_bucket"], r["new_bucket"]
        lines.append(
            f"| {name} | {r['first_call_us']:.0f} | {r['calls']} | {r['median_us']:.1f} | {r['p90_us']:.1f} | "
            f"{r['p99_us']:.1f} | {r['mean_us']:.1f} | {seen['calls']}, {seen.get('median_us', '-')} | "
            f"{new['calls']}, {new.get('median_us', '-')} | {_answered(r)} |"
        )
    lines += [
        "",
        "Every timed call has a (batch, context) pair not used before (batch 1–256, context 1–128k, "
        "log-uniform; the row inside the tuned grid draws them within the map's first and last grid lines). "
        "A pair in a batch × context bucket not seen before asks each backend's "
        "`resolve()` once for that bucket; later pairs in the bucket are answered from memory. "
        + ("Plugins loaded." if args.plugins else "Built-in backends only (--plugins loads plugins)."),
    ]
    if held is not None:
        lines += ["", f"The results folder (--results) held: {_held(held)}."]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {prefix.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
