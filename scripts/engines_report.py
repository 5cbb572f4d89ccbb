"""Engines' kernels against attnbench's: the tune record and the targets of the vLLM CPU issue.

Two subcommands, each writing ``results/engines/<name>.json`` and ``.md`` with the command,
the machine, the date and the load average:

``tune``
    runs ``attnbench tune ... --json`` with the arguments after ``--`` and records, per tuned point,
    the winner, the fastest re-timed finalist, the fastest study trial and whether the winner is
    the fastest or within the entry's switch margin of it (the dispatch-map margin policy), each
    comparison within one measurement (see ``judge``)::

        python scripts/engines_report.py tune --name tune-vllm-bf16-t1 -- \\
            --model llama-3.1-8b --batch 1,8 --context 1k,8k --dtype bf16 --threads 1 --layers 4

``targets``
    reads ``attnbench bench --save`` JSON files and checks, at bf16, context ≥ 8k and 1 thread:
    ``naive`` ≥ 0.9 × the ``matmul_probe`` row's bandwidth (``bench --probe``), and the best exact
    candidate ≥ 70 % of the measured *read* bandwidth at the same thread count: the one ``bench``
    measured right before and right after that candidate's row (``read_around``; the mean of the
    two), or, in a file from before bench measured it per row, the profile's one figure. The
    profile's share is shown beside it::

        python scripts/engines_report.py targets --name vllm-targets results/engines/bench-vllm-bf16-t1-b*.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results" / "engines"
NAIVE_OVER_PROBE = 0.9
BEST_SHARE_OF_READ = 0.70
LOSSY = {"fp8", "vllm_cpu_fp8"}


def _header(command: str, load_start: tuple[float, ...]) -> dict[str, Any]:
    return {
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(terse=True), "cpu_count": os.cpu_count()},
        "load_avg_start": list(load_start),
        "load_avg_end": list(os.getloadavg()),
    }


def _write(name: str, data: dict[str, Any], lines: list[str], *, out: Path = RESULTS) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    head = [
        f"`{data['command']}`",
        "",
        f"{data['date']} · {data['host']['platform']} · {data['host']['cpu_count']} CPUs · load average "
        f"{data['load_avg_start'][0]:.2f} → {data['load_avg_end'][0]:.2f}",
        "",
    ]
    (out / f"{name}.md").write_text("\n".join(head + lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / name}.json and .md")


def run_tune(name: str, tune_args: list[str], *, out: Path = RESULTS) -> int:
    load = os.getloadavg()
    cmd = [sys.executable, "-m", "attnbench", "tune", *tune_args, "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        print(res.stderr[-4000:], file=sys.stderr)
        return res.returncode
    report = json.loads(res.stdout)
    points = [{"row": row} | judge(entry) for row, entry in report["entries"].items()]
    data = _header("attnbench tune " + shlex.join(tune_args), load) | {"points": points, "tune": report}
    lines = [
        "| point | winner | re-timed ms | % copy bw | fastest re-timed | ms | fastest study trial | study ms "
        "| winner within margin |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        w, f, s = p["winner"] or {}, p["fastest"] or {}, p["fastest_in_study"] or {}
        lines.append(
            f"| {p['row']} | {_label(w)} | {w.get('step_ms', '-')} | {w.get('pct_of_bandwidth', '-')} | "
            f"{_label(f)} | {f.get('step_ms', '-')} | {_label(s)}{' (finalist)' if s.get('retimed') else ''} | "
            f"{s.get('study_ms', s.get('step_ms', '-'))} | {'yes' if p['ok'] else 'NO'} "
            f"({p['switch_margin']:.0%}) |"
        )
    _write(name, data, lines, out=out)
    return 0 if all(p["ok"] for p in points) else 1


def judge(entry: dict[str, Any]) -> dict[str, Any]:
    """Whether a tune entry's winner is the fastest candidate or within the switch margin of it,
    comparing only times from one measurement: the finalists' interleaved re-timing with each other,
    and the study's trials with each other (a finalist by its ``study_ms``). Two checks:

    - the fastest study trial of this run was re-timed (it is a finalist), so the interleaved round
      saw it; candidates merged from an earlier run are left out of the study's comparison;
    - the winner's re-timed median is within the margin of the fastest re-timed median.

    An entry without re-timing (``--samples 0``) has only the study's times; those are compared.
    """
    margin = float(entry.get("switch_margin", 0.0))
    cands = [c for c in entry.get("candidates", []) if c.get("step_ms") is not None]
    retimed = [c for c in cands if c.get("retimed")]
    study = [
        c for c in cands if "merged" not in c and (c.get("study_ms") is not None or not c.get("retimed"))
    ]
    winner = entry.get("winner")

    def study_time(c: dict[str, Any]) -> float:
        return float(c["study_ms"] if c.get("retimed") else c["step_ms"])

    fastest_study = min(study, key=study_time) if study else None
    pool = retimed or study
    fastest = min(pool, key=lambda c: c["step_ms"]) if pool else None
    within = bool(winner and fastest and winner["step_ms"] <= fastest["step_ms"] * (1 + margin) + 1e-12)
    seen = not retimed or bool(fastest_study and fastest_study.get("retimed"))
    return {
        "winner": winner,
        "fastest": fastest,
        "fastest_in_study": fastest_study,
        "switch_margin": margin,
        "fastest_study_trial_retimed": seen,
        "ok": within and seen,
    }


def _label(c: dict[str, Any]) -> str:
    cfg = ",".join(f"{k}={v}" for k, v in c.get("config", {}).items())
    return f"{c.get('backend', '-')}" + (f"[{cfg}]" if cfg else "")


def run_targets(name: str, files: list[Path], *, out: Path = RESULTS) -> int:
    load = os.getloadavg()
    checks = []
    for path in files:
        bench = json.loads(path.read_text())
        device = bench["device"]
        threads = device["fingerprint"].get("threads")
        read_bw = float(device["read_bandwidth"])
        rows = [r for r in bench["results"] if r.get("status") == "timed" and r.get("gbps")]
        points = sorted({(r["batch"], r["context"]) for r in rows if r["dtype"] == "bf16"})
        for batch, context in points:
            at = {r["backend"]: r for r in rows if (r["batch"], r["context"]) == (batch, context)}
            naive, probe = at.get("naive"), at.get("matmul_probe")
            exact = [r for b, r in at.items() if b not in LOSSY and b != "matmul_probe"]
            best = max(exact, key=lambda r: r["gbps"]) if exact else None
            scored = threads == 1 and context >= 8192
            around = (best or {}).get("read_around")
            point_bw = float(around["mean_bps"]) if around else read_bw
            checks.append(
                {
                    "file": path.name,
                    "threads": threads,
                    "batch": batch,
                    "context": context,
                    "read_bandwidth_gbps": point_bw / 1e9,
                    "read_measured": "around the row" if around else "profile",
                    "read_around_gbps": (
                        [around["before_bps"] / 1e9, around["after_bps"] / 1e9] if around else None
                    ),
                    "profile_read_bandwidth_gbps": read_bw / 1e9,
                    "naive_over_probe": naive["gbps"] / probe["gbps"] if naive and probe else None,
                    "best": best["backend"] if best else None,
                    "best_gbps": best["gbps"] if best else None,
                    "best_share_of_read": best["gbps"] * 1e9 / point_bw if best else None,
                    "best_share_of_profile_read": best["gbps"] * 1e9 / read_bw if best else None,
                    "scored": scored,
                }
            )
    failures = [
        c
        for c in checks
        if c["scored"]
        and (
            c["naive_over_probe"] is None
            or c["naive_over_probe"] < NAIVE_OVER_PROBE
            or (c["best_share_of_read"] or 0) < BEST_SHARE_OF_READ
        )
    ]
    scored = [c for c in checks if c["scored"]]
    verdict = (
        "NO SCORED POINT (needs 1 thread, bf16, context ≥ 8k)"
        if not scored
        else ("NO" if failures else "yes")
    )
    data = _header("python scripts/engines_report.py targets " + " ".join(f.name for f in files), load)
    data |= {"targets": {"naive_over_probe": NAIVE_OVER_PROBE, "best_share_of_read": BEST_SHARE_OF_READ}}
    data |= {"checks": checks, "met": bool(scored) and not failures}
    lines = [
        f"Targets at bf16, context ≥ 8k, 1 thread: naive ≥ {NAIVE_OVER_PROBE} × matmul_probe; best exact "
        f"candidate ≥ {BEST_SHARE_OF_READ:.0%} of the measured read bandwidth. Met: {verdict}",
        "",
        "`read GB/s`: measured right before → right after the best candidate's row, at the same threads "
        "(its share is of the mean), or `profile` where the file has only the run's one figure; "
        "`of profile read`: the same row against that one figure, for comparison.",
        "",
        "| file | threads | batch | context | read GB/s | naive / probe | best | best GB/s | best / read bw "
        "| of profile read | scored |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in checks:
        ratio = f"{c['naive_over_probe']:.2f}" if c["naive_over_probe"] is not None else "-"
        share = f"{c['best_share_of_read']:.0%}" if c["best_share_of_read"] is not None else "-"
        of_profile = (
            f"{c['best_share_of_profile_read']:.0%}" if c["best_share_of_profile_read"] is not None else "-"
        )
        pair = c["read_around_gbps"]
        read = (
            f"{c['read_bandwidth_gbps']:.1f} ({pair[0]:.1f} → {pair[1]:.1f})"
            if pair
            else f"{c['read_bandwidth_gbps']:.1f} (profile)"
        )
        best_gbps = f"{c['best_gbps']:.1f}" if c["best_gbps"] is not None else "-"
        lines.append(
            f"| {c['file']} | {c['threads']} | {c['batch']} | {c['context']} | {read} | {ratio} | {c['best']} "
            f"| {best_gbps} | {share} | {of_profile} | {'yes' if c['scored'] else ''} |"
        )
    _write(name, data, lines, out=out)
    return 0 if scored and not failures else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune", help="run attnbench tune (arguments after --) and record it")
    t.add_argument("--name", required=True, help="results/engines/<name>.json and .md")
    t.add_argument("tune_args", nargs=argparse.REMAINDER, help="-- then attnbench tune's arguments")
    g = sub.add_parser("targets", help="check the issue's targets in bench --save JSON files")
    g.add_argument("--name", required=True, help="results/engines/<name>.json and .md")
    g.add_argument("files", nargs="+", type=Path)
    for sp in (t, g):
        sp.add_argument("--out", type=Path, default=RESULTS, help="where to write (default results/engines/)")
    args = p.parse_args(argv)
    if args.cmd == "tune":
        rest = args.tune_args[1:] if args.tune_args[:1] == ["--"] else args.tune_args
        return run_tune(args.name, rest, out=args.out)
    return run_targets(args.name, args.files, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
