"""Does ``cpu_decode`` slow the work that follows it in a model's step? vLLM's step without its engine.

One thread, a Qwen2.5-0.5B-shaped step (bf16): per layer its weights' GEMVs (q, k, v, o and the MLP,
plain 4 KiB pages as vLLM's weights are), then one ``cpu_decode`` call on that layer's own cache (24
layer caches, all materialised); the LM head last. The GEMV part and the attention part are timed
apart, interleaved with a step of the GEMVs alone, for caches laid out

- ``huge:rand``: in 2 MiB pages, pages in a random order (as ``attnbench bench`` lays them out),
- ``plain:seq``: in 4 KiB pages, pages in order (as vLLM's KV tensor is), prefetch 2 and 0,
- ``huge:seq``: 2 MiB pages in order;

and ``vllm``: vLLM's own CPU kernel (the ``vllm_cpu`` backend of the attnbench-vllm plugin, its cache as
``attnbench bench`` makes it), so that the two kernels' ratio can be read in a step's conditions (the
weights' GEMVs between the layers' calls) beside their ratio side by side.

If the kernel's reads evicted the weights the GEMVs then read, the GEMV part would grow with the
attention beside it; this measures by how much, and what the pages cost the kernel itself.

    python scripts/attention_gemv_mix.py --points 1x32640,4x8192 --out results/engines/attention-gemv-mix-epyc-avx512
    python scripts/attention_gemv_mix.py --layouts huge:rand:2,vllm --out results/engines/attention-gemv-mix-vllm-epyc-avx512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attnbench.cli.common import positive_int

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_serving_bench import _points, report_header, write_report  # noqa: E402

LAYOUTS = ("huge:rand:2", "plain:seq:2", "plain:seq:0", "huge:seq:2", "vllm")
#: Qwen2.5-0.5B's per-layer weights (out, in): q, k, v, o, gate, up, down; the LM head
LAYER = ((896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864))
HEAD = (151936, 896)


def _model(batch: int, context: int, layout: str) -> Any:
    import attnbench.backends.cpu_decode as cd
    from attnbench.core.workload import Workload
    from attnbench.measure.synthetic import SyntheticModel

    if layout == "vllm":
        try:
            from attnbench_vllm.backend import VllmCpuBackend
        except ImportError as err:
            raise SystemExit(
                f"--layouts vllm: vLLM's kernel is not importable here ({err}); install vLLM's CPU build "
                "and the attnbench-vllm plugin (scripts/install-vllm.sh), or leave vllm out of --layouts"
            ) from None

        wl = Workload.uniform("qwen2.5-0.5b", batch=batch, context=context, dtype="bf16")
        m = SyntheticModel(VllmCpuBackend(), wl, config={}, num_layers=24, materialise_bytes=1 << 40)
        m.fill(extra_tokens=64)
        return m
    pages, order, prefetch = layout.split(":")
    keep = cd.empty_huge
    if pages == "plain":  # the cache in 4 KiB pages, as a torch.empty of vLLM's is
        cd.empty_huge = lambda shape, dtype: torch.empty(shape, dtype=dtype)  # type: ignore[assignment]
    try:
        wl = Workload.uniform("qwen2.5-0.5b", batch=batch, context=context, dtype="bf16")
        config = {"page_size": 128, "kv_splits": "auto", "prefetch": int(prefetch)}
        m = SyntheticModel(cd.CpuDecodeBackend(), wl, config=config, num_layers=24, materialise_bytes=1 << 40)
        m.fill(extra_tokens=64)
        if order == "seq":  # every page is filled alike: which sequence reads which is only the layout
            c = m.cache
            assert c is not None
            c.block_table.copy_(torch.arange(c.num_pages, dtype=torch.int32).view(c.batch, c.pages_per_seq))
        return m
    finally:
        cd.empty_huge = keep


def measure(
    batch: int, context: int, steps: int, layouts: tuple[str, ...] = LAYOUTS
) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)

    def w(shape: tuple[int, int]) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weights = [[w(s) for s in LAYER] for _ in range(24)]
    head = w(HEAD)
    x, xi = torch.randn(batch, 896).to(torch.bfloat16), torch.randn(batch, 4864).to(torch.bfloat16)

    def gemvs(layer: int) -> None:
        for m in weights[layer][:-1]:
            torch.nn.functional.linear(x, m)
        torch.nn.functional.linear(xi, weights[layer][-1])

    def step(model: Any | None) -> tuple[float, float]:
        plan = model.backend.plan(model.cache, num_new=[1] * batch) if model else None
        tg = ta = 0.0
        for layer in range(24):
            t0 = time.perf_counter()
            gemvs(layer)
            t1 = time.perf_counter()
            if model is not None:
                q, k, v = model.step_inputs(0)[layer]
                model.backend.decode(model.cache, plan, layer=layer, q=q, k=k, v=v)
            tg, ta = tg + t1 - t0, ta + time.perf_counter() - t1
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, head)
        return 1e3 * (tg + time.perf_counter() - t0), 1e3 * ta

    models = {layout: _model(batch, context, layout) for layout in layouts}
    got: dict[str, list[tuple[float, float]]] = {"gemv only": [], **{k: [] for k in models}}
    for _ in range(steps):
        got["gemv only"].append(step(None))
        for layout, model in models.items():
            got[layout].append(step(model))
    return {
        k: {"gemv_ms": statistics.median(a for a, _ in v), "attention_ms": statistics.median(b for _, b in v)}
        for k, v in got.items()
    }


def _layouts(text: str) -> tuple[str, ...]:
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in chosen if x not in LAYOUTS]
    if bad or not chosen:
        what = f"{', '.join(bad)} is not a layout" if bad else "no layout given"
        raise argparse.ArgumentTypeError(f"{text!r}: {what}; a comma-separated list of {', '.join(LAYOUTS)}")
    return chosen


def render(report: dict) -> str:
    lines = [
        *report_header(report, "Attention, then the weights' GEMVs: does the kernel slow what follows it?"),
        f"- {report['model']}; medians of {report['steps']} interleaved steps",
        "",
        "| batch × context | layout | GEMV part ms | GEMV growth ms | attention ms |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for row in report["rows"]:
        alone = row["runs"]["gemv only"]["gemv_ms"]
        for layout, r in row["runs"].items():
            growth = "—" if layout == "gemv only" else f"{r['gemv_ms'] - alone:+.1f}"
            attn = "—" if layout == "gemv only" else f"{r['attention_ms']:.1f}"
            lines.append(
                f"| {row['batch']} × {row['context']} | {layout} | {r['gemv_ms']:.1f} | {growth} | {attn} |"
            )
    ratios = [
        f"{row['batch']} × {row['context']}: {row['runs']['vllm']['attention_ms'] / row['runs']['huge:rand:2']['attention_ms']:.2f}"
        for row in report["rows"]
        if "vllm" in row["runs"] and "huge:rand:2" in row["runs"]
    ]
    if ratios:
        lines += ["", "vLLM's kernel / cpu_decode (huge:rand:2) in these conditions: " + "; ".join(ratios)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--points", type=_points, default=_points("1x32640,4x8192"), help="BATCHxCONTEXT points")
    p.add_argument("--steps", type=positive_int, default=8, help="interleaved steps per layout (default 8)")
    p.add_argument(
        "--layouts",
        type=_layouts,
        default=LAYOUTS,
        help=f"comma-separated, of {', '.join(LAYOUTS)} (default: all)",
    )
    p.add_argument("--out", required=True, help="output prefix: OUT.json and OUT.md")
    args = p.parse_args(argv)
    args.kv_cache_dtype = "auto"
    load = os.getloadavg()
    rows = [
        {"batch": b, "context": c, "runs": measure(b, c, args.steps, args.layouts)} for b, c in args.points
    ]
    model = "Qwen2.5-0.5B-shaped step, bf16, one thread, random weights; cpu_decode page 128, kv_splits auto"
    return write_report(args, argv, load, model=model, rows=rows, render=render, steps=args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
