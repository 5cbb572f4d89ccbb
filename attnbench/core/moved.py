"""Old import paths of modules that moved into the concept subpackages keep working, with a warning.

Until release 0.2, ``import attnbench.backend`` (and every other path in :data:`MOVED`) imports the
module at its new place, registers it under the old name too, and warns once with a
:class:`DeprecationWarning` that names the new path. ``attnbench.select`` is the function, as before;
the module behind it is :mod:`attnbench.selection.select`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Each subpackage and the old modules (under ``attnbench.``) now in it, ``old:new`` where renamed.
_NOW_IN = {
    "core": "shapes workload resolution backend kvcache registry device locations timing probe:plugin_call "
    "costmodel:traffic",
    "kernels": "triton_decode triton_utils paged split_kv fp8:fp8_cache",
    "correctness": "reference probes:needles gate triton_decode_aot:aot",
    "measure": "synthetic decode graph_step bench",
    "cost": "calibration:fit gpuspec estimate",
    "selection": "select_tuned:tuned select_heuristic:heuristic calibrated:fitted choice",
    "models": "mla",
}
#: Old module (under ``attnbench.``) → its place now.
MOVED: dict[str, str] = {
    old: f"{package}.{new or old}"
    for package, names in _NOW_IN.items()
    for old, _, new in (name.partition(":") for name in names.split())
}


class _Alias(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{self.old} moved to {self.new}; import it from there (the old path goes in attnbench 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system stamped the old name's spec on it


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        head, _, tail = fullname.partition(".")
        if head != "attnbench" or tail not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(fullname, "attnbench." + MOVED[tail]))


def install() -> None:
    """Put the old paths' finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
