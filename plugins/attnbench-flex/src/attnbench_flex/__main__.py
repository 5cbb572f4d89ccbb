"""``python -m attnbench_flex`` — compile time and decode time of the flex backend, reported apart.

Creates a flex cache for one workload (this is where ``torch.compile`` runs, timed on its own; a shape
already compiled in this process, or found in torch's on-disk cache, compiles faster), checks the
backend against the float64 reference, fills the cache with random K/V, then times decode steps with
:func:`attnbench.core.timing.measure` — after the compile, so no sample contains it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from attnbench import Workload, check
from attnbench.core.timing import measure
from attnbench.correctness.gate import random_step_inputs
from attnbench_flex.backend import FlexBackend


def report(
    workload: Workload, *, block_size: int = 128, num_layers: int = 2, repeats: int = 10
) -> dict[str, Any]:
    """Compile seconds, gate result and decode-step timing (all layers) for ``workload``."""
    backend = FlexBackend()
    config = backend.resolve_config({"block_size": block_size})
    steps = repeats + 4
    # first: this cache's warm-up is where this process compiles the shape (the gate below reuses it)
    cache = backend.create_cache(
        workload, config=config, num_layers=num_layers, max_seq_len=workload.context + steps
    )
    gate = check(backend, workload, config=config, num_layers=num_layers)
    g = workload.geometry(backend.kv_form)
    gen = torch.Generator().manual_seed(0)
    kw: dict[str, Any] = {"dtype": workload.dtype, "device": workload.device, "generator": gen}
    lens = list(workload.context_lens)
    plan = backend.plan(cache, num_new=lens)
    for layer in range(num_layers):
        _, k, v = random_step_inputs(g, backend.kv_form, batch=workload.batch, tokens=max(lens), **kw)
        backend.append(cache, plan, layer=layer, k=k, v=v)
    cache.commit(plan)
    q, k, v = random_step_inputs(g, backend.kv_form, batch=workload.batch, tokens=1, **kw)

    def step(_: int) -> None:
        p = backend.plan(cache, num_new=[1] * workload.batch)
        for layer in range(num_layers):
            backend.decode(cache, p, layer=layer, q=q[:, 0], k=k[:, 0], v=v[:, 0])
        cache.commit(p)

    timing = measure(step, device=workload.device, warmup=2, repeats=repeats)
    return {
        "workload": workload.describe(),
        "config": config,
        "implementation": backend.implementation(workload),
        "compile_seconds": cache.compile_seconds,
        "gate": gate.summary(),
        "gate_passed": gate.passed,
        "decode_step": timing.as_dict(),
        "num_layers": num_layers,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnbench_flex", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-gqa", help="attnbench shape preset or config path")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", default="1k", help="cached tokens per sequence (k/m suffixes)")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=128, choices=FlexBackend.tunables[0].choices)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    workload = Workload.uniform(
        args.model, batch=args.batch, context=args.context, dtype=args.dtype, device=args.device
    )
    reasons = FlexBackend().supports(workload)
    if reasons:
        print(f"flex cannot run {workload.describe()}: {'; '.join(reasons)}", file=sys.stderr)
        return 2
    json.dump(
        report(workload, block_size=args.block_size, num_layers=args.layers, repeats=args.repeats),
        sys.stdout,
        indent=2,
    )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
