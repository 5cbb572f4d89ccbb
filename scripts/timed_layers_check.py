"""Does a step of fewer layers time the same per layer? ``tune`` times a step of
``attnbench.measure.timed_layers()`` layers (one per distinct layer cache) and reports it as the model's
step (step × the model's layers / those run); this checks that assumption against steps of all the
model's layers, interleaved.

At each point two synthetic models of one backend and config are filled, one with the model's layers
and one with ``timed_layers()`` of them (the same distinct caches: the materialise budget is the
same), and their decode steps alternate, ``--rounds`` of each after a warm-up step. The ratio is the
fewer-layer model's median per-layer time over the full model's (1.0: the assumption holds). Prints a
table and writes ``--out``.json and .md (command, machine, date, load average).

    python scripts/timed_layers_check.py --points 1x8k,1x32k,8x8k,8x32k --out results/cpu/tune/timed-layers-check-epyc-avx512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from attnbench.cli.common import command_line, positive_int, run_line, run_record, write_report
from attnbench.core.registry import load_registry
from attnbench.core.timing import synchronize
from attnbench.core.workload import Workload, parse_tokens
from attnbench.measure import SyntheticModel, timed_layers


def _points(text: str) -> list[tuple[int, int]]:
    """An argparse ``type``: ``BATCHxCONTEXT`` points, comma-separated (``1x8k,8x32k``)."""
    out = []
    for part in text.split(","):
        b, sep, c = part.strip().lower().partition("x")
        try:
            context = parse_tokens(c, field="context") if sep and b.isdigit() and int(b) >= 1 else 0
        except ValueError:
            context = 0
        if context < 1:
            raise argparse.ArgumentTypeError(
                f"{part!r}: expected BATCHxCONTEXT, a batch ≥ 1 and a token count (k suffix accepted), e.g. 8x32k"
            )
        out.append((int(b), context))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--backend", default="cpu_decode")
    p.add_argument(
        "--points",
        type=_points,
        default=_points("1x8k,1x32k,8x8k,8x32k"),
        help="BATCHxCONTEXT, comma-separated",
    )
    p.add_argument("--rounds", type=positive_int, default=9, help="timed steps of each model (default 9)")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.json and PREFIX.md")
    args = p.parse_args(argv)
    registry = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    if args.backend not in registry.entries:
        p.error(f"--backend {args.backend!r} is not a built-in backend; one of {', '.join(registry.entries)}")
    load_start, started = os.getloadavg(), time.time()
    backend = registry.get(args.backend)
    rows = []
    for b, c in args.points:
        w = Workload.uniform(args.model, batch=b, context=c, dtype=args.dtype)
        full, few = w.shape.num_layers, timed_layers(w)
        if few == full:
            print(f"b={b} ctx={c}: timed_layers is the model's {full}: nothing to compare")
            continue
        models = {n: SyntheticModel(backend, w, num_layers=n) for n in (full, few)}
        for m in models.values():
            m.fill(extra_tokens=2 * args.rounds + 4)
            m.decode_step()  # warm-up
        per_layer: dict[int, list[float]] = {full: [], few: []}
        for r in range(args.rounds):
            for n in (full, few) if r % 2 == 0 else (few, full):
                synchronize(w.device)
                t0 = time.perf_counter()
                models[n].decode_step()
                synchronize(w.device)
                per_layer[n].append((time.perf_counter() - t0) / n * 1e3)
        for m in models.values():
            m.release()
        med = {n: statistics.median(v) for n, v in per_layer.items()}
        rows.append(
            {"batch": b, "context": c, "layers": full, "timed_layers": few, "per_layer_ms": med[full],
             "per_layer_ms_timed": med[few], "ratio": med[few] / med[full], "load_avg": list(os.getloadavg())}
        )  # fmt: skip
        r = rows[-1]
        print(
            f"b={b} ctx={c}: {full} layers {r['per_layer_ms']:.3f} ms/layer, {few} layers "
            f"{r['per_layer_ms_timed']:.3f} ms/layer, ratio {r['ratio']:.3f}"
        )
    record = run_record(
        command=command_line(args, parser=p, prog="python scripts/timed_layers_check.py"),
        load_start=load_start,
        started=started,
    )
    lines = [
        "# A step of fewer layers, per layer, against a step of all the model's layers (interleaved)",
        "",
        run_line(record) + ".",
        "",
        "| batch | context | layers | ms/layer | timed layers | ms/layer | ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['batch']} | {r['context']} | {r['layers']} | {r['per_layer_ms']:.3f} | {r['timed_layers']} "
            f"| {r['per_layer_ms_timed']:.3f} | {r['ratio']:.3f} |"
            for r in rows
        ),
        "",
    ]
    write_report(args.out, record | {"backend": args.backend, "rows": rows}, "\n".join(lines))
    print(f"wrote {args.out}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
