"""The small core modules on their own: the child runner, the contiguous KV cache, the results
location, the resolution records, the decode-step traffic formulas and the version stamp."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import attnbench
from attnbench.core.backend import base_plan
from attnbench.core.child import run_child
from attnbench.core.kvcache import ContiguousKVCache
from attnbench.core.locations import RESULTS_ENV, ResultsLocationError, check_table_file, results_location
from attnbench.core.resolution import Resolution, Tunable
from attnbench.core.shapes import load_shape
from attnbench.core.traffic import (
    KERNELS_PER_LAYER,
    kv_bytes_per_step,
    shape_kv_bytes_per_token,
    step_fixed_s,
)
from attnbench.core.version import __version__
from attnbench.core.workload import Workload

W = Workload.uniform("tiny-gqa", batch=2, context=8, dtype="fp32")


def test_run_child_reports_the_exit_status_and_the_stderr_tail() -> None:
    done = run_child(["-c", "import sys; sys.stderr.write('x' * 100 + 'END'); sys.exit(3)"], timeout=60)
    assert done.returncode == 3 and not done.timed_out
    assert done.stderr.endswith("END")
    tail = run_child(["-c", "import sys; sys.stderr.write('y' * 100 + 'END')"], timeout=60, stderr_bytes=10)
    assert tail.returncode == 0 and tail.stderr == "yyyyyyyEND"


def test_run_child_kills_a_child_past_its_deadline() -> None:
    done = run_child(["-c", "import time; time.sleep(60)"], timeout=0.5)
    assert done.timed_out and done.returncode is None


@pytest.mark.parametrize("heads_first", [True, False])
def test_contiguous_cache_reads_back_what_a_prompt_wrote(heads_first: bool) -> None:
    g = W.geometry("expanded")
    cache = ContiguousKVCache(
        workload=W, geometry=g, config={}, num_layers=1, max_seq_len=8, heads_first=heads_first
    )
    assert cache.k.shape[2 if heads_first else 3] == g.num_kv_heads
    k = torch.randn(2, 3, g.num_kv_heads, g.qk_head_dim)
    v = torch.randn(2, 3, g.num_kv_heads, g.v_head_dim)
    plan = base_plan(cache, (3, 2))  # the second prompt is one token shorter (right-padded)
    cache.write(plan, layer=0, k=k, v=v)
    cache.commit(plan)
    assert cache.seq_lens == (3, 2)
    k0, v0 = cache.read(0, 0, 3)
    assert torch.equal(k0, k[0]) and torch.equal(v0, v[0])
    k1, _ = cache.read(0, 1, 2)
    assert torch.equal(k1, k[1, :2])
    assert cache.nbytes() == cache.k.nbytes + cache.v.nbytes == 2 * 8 * g.num_kv_heads * 2 * g.qk_head_dim * 4


def test_results_location_explicit_then_env_then_default(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "env"))
    assert results_location(tmp_path / "opt").origin == "option"
    env = results_location()
    assert env.origin == "env" and env.path == tmp_path / "env"
    monkeypatch.delenv(RESULTS_ENV)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    default = results_location()
    assert default.origin == "default" and default.path == tmp_path / "xdg" / "attnbench"
    assert "per-user default" in default.describe()


def test_check_table_file_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(ResultsLocationError, match="--table"):
        check_table_file(tmp_path / "missing.yaml")
    table = tmp_path / "t.yaml"
    table.write_text("{}\n")
    assert Path(check_table_file(table)) == table


def test_tunable_default_must_be_a_choice() -> None:
    assert Tunable("block", (16, 32), 32).default == 32
    with pytest.raises(ValueError, match="not in choices"):
        Tunable("block", (16, 32), 64)


def test_a_narrowed_tunable_keeps_its_default_and_names_what_it_may_hold() -> None:
    t = Tunable("page_size", (16, 32, 64), 32, "tokens per page")
    assert t.narrowed(c for c in t.choices if c != 16) == Tunable(
        "page_size", (32, 64), 32, "tokens per page"
    )
    with pytest.raises(ValueError, match=r"narrowed choices \(16, 128\) must be among \(16, 32, 64\)"):
        t.narrowed((16, 128))
    with pytest.raises(ValueError, match=r"keep the default 32"):
        t.narrowed((16, 64))


def test_resolution_round_trips_and_refuses_with_its_reasons() -> None:
    res = Resolution("naive", W, {"a": 1}, tunables=(Tunable("a", (1, 2), 1),), kv_bytes_per_token=64)
    assert res.runnable and res.require() is res
    assert res.matches(W) and res.matches(W, {"a": 1}) and not res.matches(W, {"a": 2})
    assert Resolution.from_dict(res.as_dict(), workload=W) == res
    refused = res.refused("it hung")
    assert not refused.runnable and refused.tunables == ()
    with pytest.raises(ValueError, match="it hung"):
        refused.require()


def test_traffic_formulas() -> None:
    shape = load_shape("llama-3.1-8b")  # 32 layers, 8 KV heads of 128 dims
    assert shape_kv_bytes_per_token(shape, dtype="bf16") == 32 * 2 * 8 * 128 * 2
    assert shape_kv_bytes_per_token(shape, dtype="bf16", tp=2) == 32 * 2 * 4 * 128 * 2
    # tp beyond the KV heads: one head per GPU, replicated
    assert shape_kv_bytes_per_token(shape, dtype="bf16", tp=16) == 32 * 2 * 1 * 128 * 2
    assert kv_bytes_per_step(1000.0, tokens=8.0) == 8000.0
    assert step_fixed_s(layers=2, launch_s=1e-6, step_overhead_s=1e-3) == pytest.approx(
        1e-3 + 2 * KERNELS_PER_LAYER * 1e-6
    )


def test_the_version_stamp_is_the_package_version() -> None:
    assert __version__ == attnbench.__version__
    assert sys.modules["attnbench.core.version"].__version__ == __version__
