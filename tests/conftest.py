"""Test-wide setup. Triton kernels run through the interpreter on CPU-only machines: the variable
must be set before triton is first imported, so it is set here, before any test module loads."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["pytester"]
