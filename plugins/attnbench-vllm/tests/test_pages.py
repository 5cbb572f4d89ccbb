"""``attnbench_vllm.pages``: vLLM's KV tensor asked into 2 MiB pages without a byte of it changing.

Needs no vLLM: the module works on the tensor vLLM hands the plugin.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from attnbench_vllm import pages

MiB = 1 << 20


def _thp_madvise() -> bool:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return mode.exists() and re.search(r"\[(always|madvise)\]", mode.read_text()) is not None


def _huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+)", text).group(1))


def test_the_whole_huge_pages_inside_a_range() -> None:
    assert pages.huge_range(1, 4 * MiB) == (2 * MiB, 2 * MiB)
    assert pages.huge_range(2 * MiB, MiB) == (2 * MiB, 0)
    assert pages.huge_range(4 * MiB, 6 * MiB) == (4 * MiB, 6 * MiB)


def test_an_empty_cache_is_dropped_and_fills_in_huge_pages_with_the_same_contents() -> None:
    buf = torch.zeros(64 * MiB, dtype=torch.int8)
    layer = buf[4096:].view(-1, 64)[::2]  # a strided view, as vLLM's per-layer views are
    assert pages.advise(layer, "model.layers.0") == "dropped"
    assert pages.advise(buf[8192:], "model.layers.1") == "seen"  # once per storage
    assert not bool(buf.any())  # dropped pages read back as zeros
    before = _huge_kib()
    buf[: 32 * MiB].fill_(7)
    assert int(buf[: 32 * MiB].sum()) == 7 * 32 * MiB and not bool(buf[32 * MiB :].any())
    if _thp_madvise():
        assert _huge_kib() - before >= 16 * 1024  # most of the 32 MiB written came in 2 MiB pages


def test_a_cache_already_written_is_never_dropped() -> None:
    buf = torch.zeros(16 * MiB, dtype=torch.int8)
    buf[5 * MiB + 3] = 9  # inside the whole 2 MiB pages: a layer wrote before the first plugin layer
    assert pages.advise(buf, "model.layers.1") == "advised"
    assert int(buf[5 * MiB + 3]) == 9 and int(buf.sum()) == 9


def test_a_bad_setting_names_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pages.ENV, "yes")
    with pytest.raises(ValueError, match=r"ATTNBENCH_VLLM_HUGEPAGES='yes': expected 1 .* or 0"):
        pages.enabled()
    monkeypatch.setenv(pages.ENV, "0")
    assert not pages.enabled()
    monkeypatch.delenv(pages.ENV)
    assert pages.enabled()
