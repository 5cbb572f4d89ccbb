"""The correctness gate's command-line options, shared by ``tune``, ``bench`` and ``select``."""

from __future__ import annotations

import argparse
import math

__all__ = ["GateOptions", "add_gate_options", "gate_options"]


def add_gate_options(p: argparse.ArgumentParser, *, lossy: bool = True) -> None:
    """``--tolerance-multiple``, and ``--allow-lossy`` and ``--accuracy-budget`` with ``lossy=True``."""
    if lossy:
        p.add_argument(
            "--allow-lossy",
            action="store_true",
            help="let lossy KV caches (fp8 e4m3 K/V) compete; they are checked against exact attention with "
            "their declared bound and reported as lossy (default: exact caches only)",
        )
        p.add_argument(
            "--accuracy-budget",
            type=str,
            metavar="REL",
            help="let lossy caches compete when their rel_l2 against exact attention is at most REL "
            "(e.g. 0.05); implies --allow-lossy",
        )
    p.add_argument(
        "--tolerance-multiple",
        type=str,
        metavar="M",
        help="the gate accepts M × the error of a calibration reference that rounds as carefully as "
        "the dtype allows, per metric (default 2; backends that declare a larger multiple keep it)",
    )


class GateOptions(argparse.Namespace):
    """What the gate options say, validated."""

    allow_lossy: bool = False
    accuracy_budget: float | None = None
    error_multiple: float | None = None


def _positive(option: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{option} {text!r} is not a positive number (accepted: e.g. 2 or 0.05)")
    return value


def gate_options(args: argparse.Namespace) -> GateOptions:
    """The validated options; a bad value raises ``ValueError`` naming the option and the value."""
    out = GateOptions()
    out.accuracy_budget = _positive("--accuracy-budget", getattr(args, "accuracy_budget", None))
    out.error_multiple = _positive("--tolerance-multiple", getattr(args, "tolerance_multiple", None))
    out.allow_lossy = bool(getattr(args, "allow_lossy", False)) or out.accuracy_budget is not None
    return out
