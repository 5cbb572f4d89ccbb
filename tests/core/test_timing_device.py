"""timing.measure() and the device profile (fingerprint, bandwidth cache, remeasure)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from attnbench.core import device as device_mod
from attnbench.core.device import DeviceProfile, fingerprint, last_level_cache_bytes, load_profile
from attnbench.core.timing import Timing, measure

SMALL_BUFFER = 4 * 2**20


def test_measure_warms_up_then_rotates_inputs() -> None:
    seen: list[int] = []
    t = measure(seen.append, warmup=2, repeats=7, rotate=3)
    # warm-up runs at least one call per input set, then the timed calls cycle over them
    assert seen == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert t.repeats == 7 and t.warmup == 3
    assert 0 <= t.p10_s <= t.median_s <= t.p90_s


def test_measure_before_runs_untimed_before_each_sample() -> None:
    order: list[str] = []
    t = measure(
        lambda i: order.append(f"fn{i}"),
        warmup=1,
        repeats=4,
        rotate=2,
        before=lambda i: (order.append(f"before{i}"), time.sleep(0.02)),
    )
    assert order == ["fn0", "fn1", "before0", "fn0", "before1", "fn1", "before0", "fn0", "before1", "fn1"]
    assert t.median_s < 0.02  # the sleep in before() is not inside any sample


def test_measure_median_of_known_durations() -> None:
    t = measure(lambda i: time.sleep(0.002), warmup=1, repeats=5)
    assert 0.0015 < t.median_s < 0.2


def test_measure_max_seconds_keeps_at_least_three_samples() -> None:
    t = measure(lambda i: time.sleep(0.01), warmup=0, repeats=100, max_seconds=0.015)
    assert t.repeats == 3  # over the budget after two steps: a third all the same


def test_measure_a_step_longer_than_the_whole_budget_is_timed_once() -> None:
    t = measure(lambda i: time.sleep(0.01), warmup=0, repeats=100, max_seconds=0.005)
    assert t.repeats == 1


def test_measure_warm_seconds_stops_the_warm_up_after_a_long_call() -> None:
    calls: list[int] = []

    def step(i: int) -> None:
        calls.append(i)
        time.sleep(0.01)

    long = measure(step, warmup=3, repeats=3, warm_seconds=0.005)
    assert long.warmup == 1 and len(calls) == 1 + 3  # one warm-up call took longer than warm_seconds
    calls.clear()
    short = measure(step, warmup=3, repeats=3, warm_seconds=1.0)
    assert short.warmup == 3 and len(calls) == 3 + 3
    calls.clear()
    rotated = measure(step, warmup=1, repeats=3, rotate=2, warm_seconds=0.001)
    assert rotated.warmup == 2  # one warm-up call per input set all the same


def test_measure_bad_repeats() -> None:
    with pytest.raises(ValueError, match="repeats = 0"):
        measure(lambda i: None, repeats=0)


def test_timing_as_dict_round_trips() -> None:
    t = Timing(1.0, 0.5, 2.0, 3, 1)
    assert Timing(**t.as_dict()) == t


def test_fingerprint_names_the_cpu_and_versions() -> None:
    fp = fingerprint("cpu")
    assert fp["kind"] == "cpu" and fp["threads"] >= 1
    for key in ("name", "torch", "triton", "python", "isa"):
        assert fp[key], key


def test_last_level_cache_is_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNBENCH_LLC_BYTES", raising=False)
    assert last_level_cache_bytes("cpu") >= 2**20
    monkeypatch.setenv("ATTNBENCH_LLC_BYTES", "12345")
    assert last_level_cache_bytes("cpu") == 12345


@pytest.fixture
def counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Profile cache under tmp_path; count bandwidth measurements."""
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    calls: list[int] = []
    real = device_mod.measure_bandwidth

    def counting(device="cpu", *, nbytes=None):  # type: ignore[no-untyped-def]
        calls.append(nbytes)
        return real(device, nbytes=nbytes)

    monkeypatch.setattr(device_mod, "measure_bandwidth", counting)
    return calls


def test_profile_is_cached_per_fingerprint(counted: list[int], tmp_path: Path) -> None:
    first = load_profile(nbytes=SMALL_BUFFER)
    assert counted == [SMALL_BUFFER]
    assert first.copy_bandwidth > 0 and first.read_bandwidth > 0 and first.buffer_bytes == SMALL_BUFFER
    assert first.load_avg is not None and len(first.load_avg) == 3
    path = tmp_path / "device" / f"{first.id}.json"
    assert path.exists() and json.loads(path.read_text())["id"] == first.id
    again = load_profile(nbytes=SMALL_BUFFER)
    assert counted == [SMALL_BUFFER] and again == first
    fresh = load_profile(remeasure=True, nbytes=SMALL_BUFFER)
    assert len(counted) == 2 and fresh.id == first.id
    assert load_profile() == fresh  # the remeasured profile replaced the cached one


def test_unreadable_cache_entry_is_measured_again(counted: list[int], tmp_path: Path) -> None:
    first = load_profile(nbytes=SMALL_BUFFER)
    (tmp_path / "device" / f"{first.id}.json").write_text("{not json")
    load_profile(nbytes=SMALL_BUFFER)
    assert len(counted) == 2


def test_profile_from_dict_ignores_id_and_unknown_keys() -> None:
    p = DeviceProfile(fingerprint("cpu"), 2e10, 1e10, 123, "now", (1.0, 2.0, 3.0))
    data = json.loads(json.dumps(p.as_dict())) | {"future_field": 1}
    assert DeviceProfile.from_dict(data) == p
    assert p.bandwidth == 2e10 and p.name == fingerprint("cpu")["name"]


def test_profile_measured_on_a_busy_machine_warns(
    counted: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses
    import warnings

    monkeypatch.setattr(device_mod.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(device_mod.os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    quiet = load_profile(nbytes=SMALL_BUFFER)
    path = tmp_path / "device" / f"{quiet.id}.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a profile measured quietly loads without a warning
        assert load_profile() == quiet
    busy = dataclasses.replace(quiet, load_avg=(9.0, 8.0, 7.0))
    path.write_text(json.dumps(busy.as_dict()))
    with pytest.warns(RuntimeWarning, match=r"load average 9\.0 on 2 CPUs.*--remeasure"):
        assert load_profile() == busy
    assert device_mod.busy_note(quiet) is None


def _mappings(start: int, end: int) -> list[dict[str, str]]:
    """The smaps fields of this process's mappings that overlap [start, end)."""
    found: list[dict[str, str]] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo < end and hi > start
            if inside:
                found.append({})
        elif inside and first.endswith(":"):
            found[-1][first[:-1]] = line.split(":", 1)[1].strip()
    return found


def test_empty_huge_is_a_plain_tensor_advised_into_2_mib_pages() -> None:
    import torch

    small = device_mod.empty_huge((3, 5), torch.float32)
    assert small.shape == (3, 5) and small.dtype == torch.float32
    t = device_mod.empty_huge((5, 1024, 1024), torch.bfloat16).zero_()
    assert t.shape == (5, 1024, 1024) and t.is_contiguous() and bool((t == 0).all())
    t[4, 1023, 1023] = 3.0  # the last element is writable: the view stays inside its allocation
    assert t.sum().item() == 3.0
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if device_mod._madvise() is None or not thp.exists() or "[never]" in thp.read_text():
        return  # not Linux, or huge pages off: a plain tensor is all that is promised
    assert t.data_ptr() % device_mod.HUGE_PAGE == 0
    maps = _mappings(t.data_ptr(), t.data_ptr() + t.nbytes)
    # the advice is what empty_huge controls: the kernel marks every mapping of the tensor "hg"
    # (MADV_HUGEPAGE). Whether 2 MiB frames back it depends on the OS having free ones: a busy or
    # fragmented machine (seen on a CI runner) declines, so the grant is not asserted.
    assert maps and all("hg" in m["VmFlags"].split() for m in maps), maps


@pytest.mark.skipif(
    device_mod._madvise() is None, reason="madvise is Linux's: empty_huge is torch.empty elsewhere"
)
def test_kept_huge_buffers_are_lent_again_only_once_every_view_is_gone() -> None:
    import gc

    import torch

    shape = (3 * device_mod.HUGE_PAGE // 2,)  # 3 MiB of bf16
    device_mod.keep_huge_buffers(0)
    try:
        first = device_mod.empty_huge(shape, torch.bfloat16)
        address = first.data_ptr()
        alive = device_mod.empty_huge(shape, torch.bfloat16)  # not the live one's memory
        assert alive.data_ptr() != address
        view = first[1:]  # a view keeps the memory in use after the tensor it came from is gone
        del first
        gc.collect()
        assert device_mod.empty_huge(shape, torch.bfloat16).data_ptr() not in (address, alive.data_ptr())
        del view
        gc.collect()
        again = device_mod.empty_huge(shape, torch.bfloat16)
        assert again.data_ptr() == address  # idle now: lent again
        assert again.shape == shape and again.data_ptr() % device_mod.HUGE_PAGE == 0
        too_big = device_mod.empty_huge((4 * device_mod.HUGE_PAGE,), torch.bfloat16)  # none that size
        assert too_big.data_ptr() not in (address, alive.data_ptr())
        del again, too_big, alive
        gc.collect()
        assert device_mod._KEPT.idle_bytes() > 0
        free = device_mod.available_memory("cpu")
        assert free is not None
        device_mod.make_room(0, keep_free=free + 2**40)  # more than the machine has: every idle one freed
        assert device_mod._KEPT.idle_bytes() == 0
    finally:
        device_mod.keep_huge_buffers(None)
    assert not device_mod._KEPT.buffers
    gone = device_mod.empty_huge(shape, torch.bfloat16)
    assert not device_mod._KEPT.buffers and gone.shape == shape  # off: nothing kept


def test_keep_huge_buffers_refuses_a_negative_floor_naming_it() -> None:
    with pytest.raises(ValueError, match=r"keep_free = -1 bytes \(accepted: 0 or more, or None for off\)"):
        device_mod.keep_huge_buffers(-1)
    assert device_mod._KEPT.keep_free is None  # still off
