"""A synthetic model's decode step replayed as one CUDA graph (all layers), the way engines serve decode.

Per step: ``plan()`` on the host (a capturable backend fills the buffers its cache owns, so the
graph reads the new lengths, slots and block table), one ``graph.replay()`` holding every layer's
``decode()``, then ``commit()``. The graph is captured once per context bucket (a plan's
``bucket``/``num_splits``: split count and grid are fixed within a bucket) and captured again when
the step enters another bucket — capture happens inside the step that needs it, which is normally
one of the warm-up steps (:attr:`GraphedDecodeStep.captures` counts them).

Only caches with ``capturable = True`` can be replayed this way (see ``Backend.capturable``); CUDA only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnbench.measure.synthetic import SyntheticModel

__all__ = ["GraphedDecodeStep"]


class GraphedDecodeStep:
    """``step()`` = plan, replay the step's graph (captured per bucket), commit. Returns the last output."""

    def __init__(self, model: SyntheticModel) -> None:
        cache = model.cache
        if cache is None or not getattr(cache, "capturable", False):
            raise ValueError(f"backend {model.backend.name!r}: this cache's decode path is not capturable")
        if torch.device(model.workload.device).type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.inputs = model.step_inputs(0)  # static: the graph reads these tensors at every replay
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: Any = None
        self.out: torch.Tensor | None = None
        self.captures = 0

    def _layers(self, plan: Any) -> torch.Tensor:
        m, backend, cache = self.model, self.model.backend, self.model.cache
        assert cache is not None  # the model is set up
        out = None
        for layer in range(m.num_layers):
            q, k, v = self.inputs[layer]
            out = backend.decode(cache, plan, layer=layer % m.layers_materialised, q=q, k=k, v=v)
        assert out is not None
        return out

    def _capture(self, plan: Any) -> None:
        self.graph = None  # release the previous bucket's graph (and its memory pool) first
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (rewrites the step's own slots)
            self._layers(plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._layers(plan)
        self.graph = graph
        self.captures += 1

    def __call__(self, _: int = 0) -> torch.Tensor:
        backend, cache = self.model.backend, self.model.cache
        assert cache is not None
        plan = backend.plan(cache, num_new=[1] * self.model.batch)
        key = (type(plan), getattr(plan, "bucket", None), getattr(plan, "num_splits", None))
        if key != self.key or self.graph is None:
            self._capture(plan)
            self.key = key
        assert self.graph is not None and self.out is not None
        self.graph.replay()
        cache.commit(plan)
        return self.out
