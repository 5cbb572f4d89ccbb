"""The correctness gate's matrix over many seeds: planted bugs must fail, built-ins must pass with room.

For every cell (dtype × context, batch 1) and seed, one gate case (inputs with needle probes, the
float64 and calibration outputs) is built per cache form and shared by every candidate of that form:

- every planted wrong backend (:mod:`helpers.planted`) must fail, every seed;
- every built-in backend that runs natively here must pass, with its worst error at most 0.8 of its
  bound (``bound share`` = worst over metrics of error / bound); Triton backends, interpreted on a CPU,
  only at the contexts given by ``--interpreted-contexts``.

Seeds: ``--seeds`` for the built-ins that run natively, fewer for the planted bugs (each must fail
every one; the test suite runs the whole bug matrix on every CI run) and for interpreted Triton.
Geometry: llama-3.1-8b's attention (32 query heads over 8 KV heads of 128, 2 layers) up to
``--full-geometry-max`` tokens, a smaller one above (2 layers, 8 query heads over 2 KV heads of 32);
the latent (MLA) form on ``tiny-mla``. Writes ``<out>.json`` and ``<out>.md`` with the command, the
machine, the date and the load average (accuracy only: no timing, so load does not change a number).

    python scripts/gate_matrix.py --seeds 30 --out results/gate/gate-matrix-cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run interpreted on a CPU (checked only)
# the planted wrong backends are test fixtures: tests/helpers/planted.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

from helpers.planted import GATE_SMALL, PLANTED, PLANTED_LATENT, Precise, PreciseLatent

from attnbench.cli.common import command_line, run_record, write_report
from attnbench.core.registry import load_registry
from attnbench.core.shapes import load_shape
from attnbench.core.workload import Workload, parse_int_list
from attnbench.correctness.gate import check, prepare_case

SMALL = GATE_SMALL


def _contexts(text: str) -> list[int]:
    return parse_int_list(text, field="contexts")


def _candidates(
    form: str,
    *,
    interpreted_ok: bool,
    dtype: str,
    only: set[str] | None = None,
    planted: bool = True,
    latent: str = "tiny-mla",
) -> dict[str, tuple]:
    """name -> (backend, config, planted?) for one cache form and dtype (``only``: these built-ins)."""
    registry = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    probe = Workload(SMALL if form == "expanded" else load_shape(latent), (64,), dtype, "cpu")
    out: dict[str, tuple] = {}
    for entry in registry:
        b = entry.cls()
        if entry.source.kind != "builtin" or b.kv_form != form or b.supports(probe):
            continue
        if only is not None and b.name not in only:
            continue
        if b.name == "mla":
            out["mla[torch]"] = (b, {"kernel": "torch"}, False)
            if interpreted_ok:
                out["mla[triton]"] = (b, None, False)
            continue
        if b.interpreted(probe) and not interpreted_ok:
            continue
        out[b.name] = (b, None, False)
    if not planted:
        return out
    base, bugs = (Precise, PLANTED) if form == "expanded" else (PreciseLatent, PLANTED_LATENT)
    out["precise (planted base)"] = (base(), None, False)
    for name, cls in bugs.items():
        out[name] = (cls(), None, True)
    return out


def _seeds_for(name: str, cand: tuple, args: argparse.Namespace) -> int:
    planted = cand[2]
    if planted:
        return min(args.seeds, args.planted_seeds)
    if name == "mla[triton]" or name == "triton_paged":
        return min(args.seeds, args.interpreted_seeds)
    return args.seeds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--contexts", default="1k,8k,32k,128k")
    ap.add_argument("--interpreted-contexts", default="1k", help="contexts where Triton runs interpreted")
    ap.add_argument("--planted-seeds", type=int, default=5, help="seeds for the planted bugs (default 5)")
    ap.add_argument(
        "--interpreted-seeds", type=int, default=5, help="seeds for interpreted Triton backends (default 5)"
    )
    ap.add_argument("--full-geometry-max", default="8k", help="llama-3.1-8b geometry up to this context")
    ap.add_argument(
        "--backends", default="", help="comma-separated built-ins to run (default: every one that runs here)"
    )
    ap.add_argument(
        "--no-planted", action="store_true", help="leave out the planted bugs and their precise base"
    )
    ap.add_argument(
        "--latent-model",
        default="tiny-mla",
        help="the latent (MLA) form's geometry: a preset or shape YAML (default tiny-mla; deepseek-v3 "
        "for kernels whose tiles need a 576-wide row)",
    )
    ap.add_argument("--out", default="results/gate/gate-matrix-cpu")
    args = ap.parse_args()
    only = {n.strip() for n in args.backends.split(",") if n.strip()} or None
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds} must be ≥ 1")
    full_max = _contexts(args.full_geometry_max)[0]
    interp = set(_contexts(args.interpreted_contexts))
    start, load_start = time.time(), os.getloadavg()
    cells: list[dict] = []
    for dtype in args.dtypes.split(","):
        for ctx in _contexts(args.contexts):
            for form in ("expanded", "latent"):
                if form == "latent":
                    shape = load_shape(args.latent_model)
                else:
                    shape = load_shape("llama-3.1-8b") if ctx <= full_max else SMALL
                workload = Workload(shape, (ctx,), dtype, "cpu")
                cands = _candidates(
                    form,
                    interpreted_ok=ctx in interp,
                    dtype=dtype,
                    only=only,
                    planted=not args.no_planted,
                    latent=args.latent_model,
                )
                if not cands:
                    continue
                stats = {
                    n: {"fails": 0, "worst_share": 0.0, "worst_rel_l2": 0.0, "worst_ratio": 0.0}
                    for n in cands
                }
                min_retrieval = {n: 1.0 for n in cands}
                seeds = {n: _seeds_for(n, c, args) for n, c in cands.items()}
                for seed in range(args.seeds):
                    case = prepare_case(workload, form=form, seed=1000 * seed + ctx % 997)
                    for name, (backend, config, _) in cands.items():
                        if seed >= seeds[name]:
                            continue
                        r = check(backend, workload, case=case, config=config)
                        st = stats[name]
                        st["fails"] += 0 if r.passed else 1
                        st["worst_share"] = max(st["worst_share"], r.bound_share())
                        st["worst_rel_l2"] = max(st["worst_rel_l2"], r.error.rel_l2)
                        st["worst_ratio"] = max(st["worst_ratio"], r.ratios().get("rel_l2", 0.0))
                        min_retrieval[name] = min(min_retrieval[name], r.retrieval)
                for name, (backend, config, planted) in cands.items():
                    cells.append(
                        {
                            "dtype": dtype,
                            "context": ctx,
                            "form": form,
                            "geometry": f"{shape.name} ({shape.num_heads}/{shape.num_kv_heads}×{shape.head_dim})",
                            "candidate": name,
                            "implementation": backend.resolve(workload, config).implementation,
                            "planted": planted,
                            "seeds": seeds[name],
                            "multiple": backend.error_multiple(workload.dtype, config=config),
                            "min_retrieval": min_retrieval[name],
                            **stats[name],
                        }
                    )
                print(
                    f"{dtype} {ctx} {form}: done ({time.time() - start:.0f} s)", file=sys.stderr, flush=True
                )
    command = command_line(args, parser=ap, prog="python scripts/gate_matrix.py")
    report = run_record(command=command, load_start=load_start, started=start) | {
        "cells": cells,
    }
    write_report(args.out, report, _markdown(report))
    bad = [
        c
        for c in cells
        if (c["planted"] and c["fails"] < c["seeds"])
        or (not c["planted"] and (c["fails"] or c["worst_share"] > 0.8))
    ]
    print(_markdown(report))
    for c in bad:
        print(f"NOT MET: {c['candidate']} {c['dtype']} {c['context']}: {c}", file=sys.stderr)
    return 1 if bad else 0


def _markdown(report: dict) -> str:
    lines = [
        "# Correctness gate matrix",
        "",
        f"`{report['command']}` — {report['machine']}, torch {report['torch']}, {report['date']}, "
        f"load average {report['load_avg_start'][0]:.2f} → {report['load_avg_end'][0]:.2f} "
        f"({report['seconds']:.0f} s; accuracy only, nothing timed); CPU: {report.get('cpu', 'not recorded')}.",
        "",
        "Planted bugs: failures out of the seeds (must be all). Built-ins: failures (must be 0) and the worst "
        "error as a share of the bound over the seeds (must be ≤ 0.8); `ratio` = worst rel_l2 / the "
        "calibration's; `multiple` = what the bound allows. Implementations (what ran): "
        + "; ".join(
            sorted(
                {
                    f"{c['candidate']}: `{c['implementation']}`"
                    for c in report["cells"]
                    if c.get("implementation")
                }
            )
        )
        + ".",
        "",
        "| dtype | context | geometry | candidate | fails / seeds | worst share of bound | worst rel_l2 | ratio | multiple | min retrieval |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report["cells"]:
        tag = " (planted)" if c["planted"] else ""
        lines.append(
            f"| {c['dtype']} | {c['context']} | {c['geometry']} | {c['candidate']}{tag} | {c['fails']} / {c['seeds']} "
            f"| {c['worst_share']:.3g} | {c['worst_rel_l2']:.3g} | {c['worst_ratio']:.3g} | {c['multiple']:g} "
            f"| {c['min_retrieval']:.0%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
