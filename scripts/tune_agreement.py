"""Does a faster tuner pick what the full search picks? Two tuned tables of one device, key by key.

For every key both tables hold, the two winners are gated and re-timed
**interleaved** in one worker (the tuner's own re-timing, :func:`attnbench.tuning.interleave.retime`),
so the comparison does not depend on either run's load. A key agrees when both picked the same
candidate, or when neither winner beats the other beyond both intervals by the switch margin
(:func:`attnbench.tables.margin.beats`: the policy the tuner decides by); the ratio is the fast
table's winner over the full table's, by the medians::

    python scripts/tune_agreement.py --full FULL/tuning-<device>.yaml --fast FAST/tuning-<device>.yaml \
        --out results/cpu/tune/quickstart/agreement-epyc-avx512

Written: ``<out>.json`` and ``<out>.md`` with the command, machine, date and load average.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from attnbench.cli.common import run_line, run_record, write_report
from attnbench.core.workload import Workload
from attnbench.tables import ResultsTable, TableError
from attnbench.tables.margin import beats
from attnbench.tables.table_schema import CandidateResult
from attnbench.tuning import Worker, backend_refs
from attnbench.tuning.interleave import Finalist, retime


def _label(c: CandidateResult) -> str:
    cfg = ",".join(f"{k}={v}" for k, v in sorted(c.config.items()))
    return f"{c.backend}[{cfg}]" if cfg else c.backend


def _winners(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SystemExit(
            f"tune_agreement: {path}: no such file (a tuning-<device>.yaml that attnbench tune wrote)"
        )
    try:
        return ResultsTable.load(path).typed()
    except (OSError, TableError) as err:
        raise SystemExit(f"tune_agreement: {path}: {err}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", type=Path, required=True, help="the full search's table (tuning-<device>.yaml)")
    p.add_argument("--fast", type=Path, required=True, help="the faster tuner's table of the same device")
    p.add_argument("--samples", type=int, default=15, help="interleaved rounds per key (default 15)")
    p.add_argument("--out", type=Path, required=True, help="output prefix (<out>.json and <out>.md)")
    args = p.parse_args(argv)
    load_start, started = os.getloadavg(), time.time()
    full, fast = _winners(args.full), _winners(args.fast)
    keys = sorted(set(full) & set(fast))
    if not keys:
        raise SystemExit(f"tune_agreement: {args.full} and {args.fast} hold no key in common")
    refs = {r.name: r.ref for r in backend_refs()}
    rows = []
    with Worker() as worker:
        for key in keys:
            a, b = full[key], fast[key]
            if a.winner is None or b.winner is None:
                continue
            missing = sorted({a.winner.backend, b.winner.backend} - set(refs))
            if missing:
                raise SystemExit(
                    f"tune_agreement: {key}: winner backend {missing[0]!r} is not registered here; "
                    f"registered: {', '.join(sorted(refs))} (plugins off? unset ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD)"
                )
            w = Workload.uniform(a.model, batch=a.batch_bucket, context=a.context_bucket, dtype=a.dtype)
            picks = {_label(a.winner): a.winner, _label(b.winner): b.winner}
            fins = [Finalist(lbl, c.backend, refs[c.backend], dict(c.config)) for lbl, c in picks.items()]
            got = retime(worker, fins, workload=w, samples=args.samples, check=True)
            la, lb = _label(a.winner), _label(b.winner)
            if got.failed or la not in got.times or lb not in got.times:
                rows.append({"key": key, "full": la, "fast": lb, "failed": got.failed})
                continue
            ta, tb = got.times[la], got.times[lb]
            verdict = (
                "same"
                if la == lb
                else "full's faster"
                if beats(ta, tb)
                else "fast's faster"
                if beats(tb, ta)
                else "within the margin"
            )
            rows.append(
                {
                    "key": key,
                    "full": la,
                    "fast": lb,
                    "full_ms": [round(ta.median_ms, 4), round(ta.lo_ms, 4), round(ta.hi_ms, 4)],
                    "fast_ms": [round(tb.median_ms, 4), round(tb.lo_ms, 4), round(tb.hi_ms, 4)],
                    "ratio": round(tb.median_ms / ta.median_ms, 4),
                    "verdict": verdict,
                }
            )
            print(f"{key}: {verdict} — full {la} {ta.median_ms:.3f} ms, fast {lb} {tb.median_ms:.3f} ms")
    command = "python scripts/tune_agreement.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    record = run_record(command=command, load_start=load_start, started=started)
    agree = all(r.get("verdict") in ("same", "within the margin", "fast's faster") for r in rows)
    report = record | {"rows": rows, "agree": agree and len(rows) == len(keys)}
    lines = [
        "# Does the faster tuner pick what the full search picks?",
        "",
        run_line(record) + ".",
        "",
        "| key | full search's winner | faster tuner's winner | full ms [95 % interval] | fast ms | fast / full | verdict |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "verdict" not in r:
            lines.append(f"| {r['key']} | {r['full']} | {r['fast']} | — | — | — | failed: {r['failed']} |")
            continue
        fa, fb = r["full_ms"], r["fast_ms"]
        lines.append(
            f"| {r['key']} | {r['full']} | {r['fast']} | {fa[0]:.3f} [{fa[1]:.3f}, {fa[2]:.3f}] | "
            f"{fb[0]:.3f} [{fb[1]:.3f}, {fb[2]:.3f}] | {r['ratio']:.3f} | {r['verdict']} |"
        )
    lines += ["", f"agree: {'yes' if report['agree'] else 'no'}", ""]
    write_report(args.out, report, "\n".join(lines))
    print(f"agree: {'yes' if report['agree'] else 'no'} ({args.out}.md)")
    return 0 if report["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
