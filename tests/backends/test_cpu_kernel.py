"""The compiled kernel (``attnbench.backends.cpu_kernel``): the build cache, the builds, the sanitizer setting
and the source-tree override."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnbench.backends import cpu_kernel


def test_build_is_cached_per_source_and_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = cpu_kernel.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    first = cpu_kernel.build_library()
    assert first.parent == tmp_path / "cpu_decode" and first.name.startswith("cpu_decode-")
    mtime = first.stat().st_mtime_ns
    assert cpu_kernel.build_library() == first and first.stat().st_mtime_ns == mtime  # no rebuild
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind
    monkeypatch.setattr(cpu_kernel, "FLAGS", (*cpu_kernel.FLAGS, "-DCPU_DECODE_NO_AVX512"))
    assert cpu_kernel.build_library() != first  # other flags, other library


def test_each_build_is_its_own_library_and_says_which_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cpu_kernel.find_compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    paths = {build: cpu_kernel.build_library(build) for build in cpu_kernel.BUILDS}
    assert len(set(paths.values())) == len(cpu_kernel.BUILDS)
    # load_kernel's per-process cache would otherwise keep these temporary libraries for the later tests
    # (whose cpu_decode_fail_alloc would then set another library's counter than the backends call)
    cpu_kernel.load_kernel.cache_clear()
    try:
        native, emulated = cpu_kernel.load_kernel("native"), cpu_kernel.load_kernel("amx-emulated")
        assert not isinstance(native, str) and not isinstance(emulated, str)
        assert native.path == paths["native"] and emulated.path == paths["amx-emulated"]
        assert (native.build, native.amx_emulated) == ("native", False)
        assert (emulated.build, emulated.amx_emulated) == ("amx-emulated", True)
        assert emulated.isa == native.isa  # the emulation changes the tiles only
    finally:
        cpu_kernel.load_kernel.cache_clear()


def test_bad_builds_and_sanitizers_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"cpu_decode build 'amx' unknown; builds: native, amx-emulated"):
        cpu_kernel.build_flags("amx")
    monkeypatch.setenv("ATTNBENCH_CPU_DECODE_SANITIZE", "thread")
    with pytest.raises(
        ValueError, match=r"ATTNBENCH_CPU_DECODE_SANITIZE='thread': expected one of address or unset"
    ):
        cpu_kernel.build_flags()
    monkeypatch.setenv("ATTNBENCH_CPU_DECODE_SANITIZE", "address")
    assert "-fsanitize=address" in cpu_kernel.build_flags("amx-emulated")
