"""Device profile: a fingerprint of the machine and its measured memory bandwidth (the roofline).

The bandwidth is measured once per fingerprint with a large copy (bytes read + bytes written over the
median time) and a large read (a sum), and cached as JSON under ``$ATTNBENCH_CACHE_DIR`` (default
``~/.cache/attnbench``). ``load_profile(remeasure=True)`` (``--remeasure`` on the command line)
measures again. The buffer is far larger than the last-level cache (on CPU: twice the LLC, 512 MiB to
1 GiB; on CUDA 2 GiB), so the figure is DRAM/HBM bandwidth, not cache bandwidth. The load average at
measurement time is recorded too: on a shared machine the figure is only as good as the quiet it got.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from attnbench.core.timing import measure

__all__ = [
    "DeviceProfile",
    "ReadMeter",
    "available_memory",
    "cache_dir",
    "empty_huge",
    "fingerprint",
    "keep_huge_buffers",
    "last_level_cache_bytes",
    "load_profile",
    "make_room",
    "measure_bandwidth",
    "resolve_device",
    "triton_version",
]

#: The device every command and :func:`attnbench.select` use by default: CUDA when available, else CPU.
AUTO = "auto"


def resolve_device(device: str | torch.device = AUTO) -> str:
    """``"auto"`` → ``"cuda"`` when torch sees a CUDA GPU, else ``"cpu"``; anything else unchanged
    (validated where it is used: a ``Workload`` names the field and why, e.g. a CPU-only torch)."""
    if isinstance(device, torch.device):
        return str(device)
    if device.strip().lower() == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def available_memory(device: str) -> int | None:
    """Bytes that can still be allocated on ``device`` without pushing anything out: free GPU memory on
    CUDA, the kernel's ``MemAvailable`` on Linux; ``None`` where unknown."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("ATTNBENCH_CACHE_DIR") or Path.home() / ".cache" / "attnbench")


def last_level_cache_bytes(device: str | torch.device = "cpu") -> int:
    """Size of the device's last-level cache (CPU: the largest cache sysfs lists; CUDA: L2); 32 MiB if
    unknown. ``ATTNBENCH_LLC_BYTES`` overrides it (tests use a small value)."""
    if os.environ.get("ATTNBENCH_LLC_BYTES"):
        return int(os.environ["ATTNBENCH_LLC_BYTES"])
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 32 * 2**20)
    best = 0
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            size = (index / "size").read_text().strip()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:].upper(), 1)
            best = max(best, int(size.rstrip("KMGkmg")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 * 2**20


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def triton_version() -> str:
    try:  # deferred: triton takes a second to import and the fingerprint may be read without it
        import triton

        return triton.__version__
    except Exception:  # triton missing or broken: the fingerprint says so
        return "unavailable"


def fingerprint(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What identifies this device for tuning: name, capability or CPU, threads, library versions."""
    dev = torch.device(device)
    fp: dict[str, Any] = {
        "kind": dev.type,
        "torch": torch.__version__,
        "triton": triton_version(),
        "python": platform.python_version(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        fp |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sm_count": props.multi_processor_count,
            "cuda": torch.version.cuda,
            "driver": _driver_version(),
        }
    else:
        fp |= {
            "name": _cpu_name(),
            "arch": platform.machine(),
            "threads": torch.get_num_threads(),
            "isa": torch.backends.cpu.get_cpu_capability(),
        }
    return fp


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, IndexError, Exception):
        return "unknown"


def fingerprint_id(fp: dict[str, Any]) -> str:
    """Short stable id of a fingerprint (hardware + versions)."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class DeviceProfile:
    """The device's fingerprint and measured bandwidths in bytes/s."""

    fingerprint: dict[str, Any]
    copy_bandwidth: float  # (read + write) bytes / s of a large copy
    read_bandwidth: float  # bytes / s of a large reduction
    buffer_bytes: int
    measured_at: str
    load_avg: tuple[float, float, float] | None = None  # os.getloadavg() when measured (CPU noise)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceProfile:
        """Inverse of :meth:`as_dict` (ignores ``id`` and keys it does not know)."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        if fields.get("load_avg") is not None:
            fields["load_avg"] = tuple(fields["load_avg"])
        return cls(**fields)

    @property
    def id(self) -> str:
        return fingerprint_id(self.fingerprint)

    @property
    def name(self) -> str:
        return str(self.fingerprint.get("name", "unknown"))

    @property
    def bandwidth(self) -> float:
        """The roofline every figure is reported against: the measured copy bandwidth."""
        return self.copy_bandwidth

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"id": self.id}


#: Linux's transparent huge page size, and madvise's MADV_HUGEPAGE
HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise`` on Linux, else None."""
    if platform.system() != "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory the OS is asked to back with 2 MiB pages.

    A KV cache read from DRAM page by page in a random page order takes a TLB miss every 4 KiB with
    the default pages (each page of a layer's cache holds a few KiB per KV head); on Linux, where
    transparent huge pages are enabled ``always`` or ``madvise``, this asks for huge pages
    (``madvise(MADV_HUGEPAGE)``, 2 MiB-aligned, before the memory is first touched), as torch's
    ``THP_MEM_ALLOC_ENABLE=1`` does for every allocation. Below 2 MiB, elsewhere, or if the OS
    declines, it is a plain ``torch.empty``: the advice changes the speed, never the contents.
    While :func:`keep_huge_buffers` is on, the memory of a tensor that died is lent again.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = _KEPT.lend(nbytes + HUGE_PAGE)
    fresh = raw is None
    if raw is None:
        _KEPT.trim(nbytes + HUGE_PAGE)
        _KEPT.swap(nbytes + HUGE_PAGE)
        raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
        _KEPT.keep(raw)
    offset = -raw.data_ptr() % HUGE_PAGE
    if fresh:  # a lent buffer was advised when it was made
        madvise(raw.data_ptr() + offset, nbytes, _MADV_HUGEPAGE)  # a refusal (errno) leaves 4 KiB pages
    return raw[offset : offset + nbytes].view(dtype).view(shape)


class _KeptBuffers:
    """The buffers :func:`empty_huge` allocated while :func:`keep_huge_buffers` is on, held after their
    tensors die (a buffer is idle when nothing but this list uses its memory) and lent again.

    Memory touched for the first time costs far more than a write: the OS finds, zeroes and, in a
    virtual machine, the host backs every page, and memory a process gave back is soon reclaimed (a
    2 GiB cache in 2 MiB pages on a 2-core VM: 4–6 s the first time or 8 s after a free, 0.3 s right
    after a free, 0.13 s to zero it again). The tuner's worker makes, frees and makes again caches of
    similar sizes for an hour; it keeps them instead."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.keep_free: int | None = None  # None: off

    @staticmethod
    def _idle(raw: torch.Tensor) -> bool:  # the list's reference and this call's storage handle
        return torch._C._storage_Use_Count(raw.untyped_storage()._cdata) <= 2

    def idle_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers if self._idle(b))

    def lend(self, nbytes: int) -> torch.Tensor | None:
        """The smallest idle buffer of ``nbytes`` to 1.5 × ``nbytes``, else None (a larger one would hold
        more memory than the tensor needs for as long as it lives)."""
        fits = [b for b in self.buffers if nbytes <= b.numel() <= 1.5 * nbytes and self._idle(b)]
        return min(fits, key=lambda b: b.numel()) if fits else None

    def _free_idle(self, enough: Callable[[int], bool]) -> None:
        """Free idle buffers, the largest first, until ``enough(bytes freed so far)``; each one's memory
        goes back to the OS as it is dropped (no reference to it is left here)."""
        idle = sorted((b for b in self.buffers if self._idle(b)), key=lambda b: -b.numel())
        freed = 0
        while idle and not enough(freed):
            raw = idle.pop(0)
            freed += raw.numel()
            self.buffers = [b for b in self.buffers if b is not raw]  # by identity: == compares elements
            del raw

    def swap(self, nbytes: int) -> None:
        """Free idle buffers, the largest first, until ``nbytes`` are freed: allocated right after, a new
        buffer of a size none fits takes memory the OS has not reclaimed yet (0.3 s for 2 GiB)."""
        self._free_idle(lambda freed: freed >= nbytes)

    def keep(self, raw: torch.Tensor) -> None:
        if self.keep_free is not None:
            self.buffers.append(raw)

    def trim(self, need: int, keep_free: int | None = None) -> None:
        """Free idle buffers, the largest first, until ``need`` more bytes leave ``keep_free`` (default:
        the kept setting) free."""
        floor = self.keep_free if keep_free is None else keep_free
        if floor is not None:
            self._free_idle(lambda _: (free := available_memory("cpu")) is None or free - need >= floor)


_KEPT = _KeptBuffers()


def keep_huge_buffers(keep_free: int | None) -> None:
    """Keep :func:`empty_huge`'s buffers in this process after their tensors die, and lend them to the
    next tensors of their size; ``None`` turns it off and frees the idle ones. ``keep_free``: the bytes
    the machine keeps free at the least — an idle buffer is freed before a new buffer, or
    :func:`make_room`, would leave less. For a process that makes caches over and over (the tuner's
    worker), never for a library's caller, whose memory must come back when its tensors die."""
    if keep_free is not None and keep_free < 0:
        raise ValueError(
            f"keep_huge_buffers: keep_free = {keep_free} bytes (accepted: 0 or more, or None for off)"
        )
    if not hasattr(torch._C, "_storage_Use_Count"):  # a torch that cannot say a buffer is idle: off
        keep_free = None
    _KEPT.keep_free = keep_free
    if keep_free is None:
        _KEPT.buffers.clear()  # the idle ones freed; a live tensor keeps its own memory


def make_room(nbytes: int, *, keep_free: int | None = None) -> None:
    """Free kept idle buffers (:func:`keep_huge_buffers`), the largest first, until ``nbytes`` more leave
    ``keep_free`` (default: what it keeps free) free; nothing where none are kept. Before allocating what
    :func:`empty_huge` may not lend."""
    _KEPT.trim(nbytes, keep_free)


def _random_buffer(n: int, device: torch.device) -> torch.Tensor:
    """``n`` random float32 values to measure bandwidth with: on a CPU in 2 MiB pages, as the CPU
    kernels' caches are (:func:`empty_huge`), so that a share of it compares like with like."""
    if device.type == "cpu":  # one random MiB repeated: the same traffic, 1/30 of normal_()'s time
        out = empty_huge((n,), torch.float32)
        chunk = 1 << 18
        whole = n - n % chunk
        out[:whole].view(-1, chunk).copy_(torch.randn(chunk).expand(whole // chunk, chunk))
        out[whole:].normal_()
        return out
    return torch.randn(n, device=device)


def measure_bandwidth(
    device: str | torch.device = "cpu", *, nbytes: int | None = None
) -> tuple[float, float, int]:
    """(copy bytes/s, read bytes/s, buffer bytes) from a buffer far larger than any cache."""
    dev = torch.device(device)
    if nbytes is None:
        llc = last_level_cache_bytes(dev)
        nbytes = 2 * 2**30 if dev.type == "cuda" else min(max(512 * 2**20, 2 * llc), 2**30)
    n = nbytes // 4
    src, dst = _random_buffer(n, dev), _random_buffer(n, dev)
    copy = measure(lambda i: dst.copy_(src), device=dev, warmup=3, repeats=15 if dev.type == "cuda" else 9)
    return 2 * n * 4 / copy.median_s, _read_rate(src), n * 4


def _read_rate(src: torch.Tensor) -> float:
    """Bytes / s of a sum over ``src`` (median of several passes)."""
    read = measure(lambda i: src.sum(), device=src.device, warmup=3, repeats=15 if src.is_cuda else 9)
    return src.numel() * src.element_size() / read.median_s


class ReadMeter:
    """The read bandwidth measured again on demand, with the profile's buffer allocated once.

    On a shared or virtual machine the read bandwidth moves by a third within minutes (seen on the
    project's 2-vCPU VM: 20–31 GB/s at one thread), so a share of it is only as good as the time
    between the two measurements. ``bench`` calls this right before and right after each timed row, at
    the run's thread count, and reports the row's share against the mean of the two. A buffer that
    would fit the last-level cache measures the cache, not memory: then ``available`` is false and
    nothing is measured.
    """

    def __init__(self, device: str | torch.device, nbytes: int) -> None:
        self.device = torch.device(device)
        self.nbytes = int(nbytes)
        self.available = self.nbytes >= 2 * last_level_cache_bytes(self.device)
        self._src: torch.Tensor | None = None

    def __call__(self) -> float | None:
        """Bytes / s now, or ``None`` when the buffer would be cache-resident (see the class)."""
        if not self.available:
            return None
        if self._src is None:
            self._src = _random_buffer(self.nbytes // 4, self.device)
        return _read_rate(self._src)


def load_profile(
    device: str | torch.device = "cpu", *, remeasure: bool = False, nbytes: int | None = None
) -> DeviceProfile:
    """The cached profile for this device's fingerprint, measuring it first if needed.

    ``remeasure=True`` measures again and overwrites the cache entry; ``nbytes`` sets the buffer size
    of a measurement (default: see :func:`measure_bandwidth`; tests use a small one).
    """

    fp = fingerprint(device)
    path = cache_dir() / "device" / f"{fingerprint_id(fp)}.json"
    if path.exists() and not remeasure:
        try:
            profile = DeviceProfile.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, AttributeError):
            pass  # unreadable cache entry: measure again and overwrite it
        else:
            _warn_if_busy(profile)
            return profile
    copy_bw, read_bw, size = measure_bandwidth(device, nbytes=nbytes)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    profile = DeviceProfile(fp, copy_bw, read_bw, size, now, os.getloadavg())
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        json.dump(profile.as_dict(), tmp, indent=2)
    os.replace(tmp.name, path)
    _warn_if_busy(profile)
    return profile


def busy_note(profile: DeviceProfile) -> str | None:
    """Why ``profile``'s bandwidth is suspect, or ``None``: a CPU profile measured while the machine's
    1-minute load average exceeded its CPU count (every core had a queue) shares the memory bus with other work, so its
    bandwidth reads low and every "% of bandwidth" against it reads high (seen here: 6.4 GB/s at load
    ~10 against 25.7 GB/s quiet, on the same 2-vCPU machine)."""
    load = getattr(profile, "load_avg", None)
    cpus = os.cpu_count() or 1
    if profile.fingerprint.get("kind") != "cpu" or not load or load[0] <= cpus:
        return None
    return (
        f"device profile {profile.id} was measured at load average {load[0]:.1f} on {cpus} CPUs: its "
        f"bandwidth ({profile.bandwidth / 1e9:.2f} GB/s) is likely low and every % of bandwidth high; "
        "measure again on a quiet machine (`attnbench bench --remeasure`)"
    )


def _warn_if_busy(profile: DeviceProfile) -> None:
    note = busy_note(profile)
    if note:
        warnings.warn(note, RuntimeWarning, stacklevel=3)
