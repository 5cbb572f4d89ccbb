"""Bad input and broken surroundings, tried as a new user would: each is one line on stderr naming
what was wrong and what is accepted, with a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.fake_plugins import plugin_env, write_fake_dist

from attnbench.cli import main

TINY = ["--model", "tiny-gqa", "--batch", "1", "--context", "64", "--dtype", "fp32"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cuda is valid")


def _one_line_error(capsys, argv, *, match):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert match in err, err
    return err


@no_cuda
@pytest.mark.parametrize("command", ["bench", "tune", "select"])
def test_device_cuda_on_a_cpu_torch(command, capsys, tmp_path):
    _one_line_error(
        capsys,
        [command, *TINY, "--device", "cuda", *(["--results", str(tmp_path)] if command != "bench" else [])],
        match="field 'device' = 'cuda': this torch build has no CUDA",
    )


@no_cuda
def test_device_cuda_for_decode_and_select_api(capsys):
    _one_line_error(
        capsys, ["decode", "-m", "tiny-gqa", "-p", "4", "-n", "2", "--device", "cuda"], match="no CUDA"
    )
    import attnbench

    with pytest.raises(ValueError, match="field 'device' = 'cuda'"):
        attnbench.select(model="tiny-gqa", batch=1, context=64, device="cuda")


def test_a_context_too_large_for_memory_is_refused_before_allocating(capsys):
    _one_line_error(
        capsys,
        ["bench", "-m", "tiny-gqa", "-b", "1", "-c", "4000m", "--dtype", "fp32"],
        match="KV cache for a single layer",
    )


def test_a_config_json_with_a_non_integer_field(capsys, tmp_path):
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": "eight",
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    _one_line_error(
        capsys, ["bench", "-m", str(tmp_path / "config.json"), "-c", "64"], match="'num_key_value_heads'"
    )


def test_storage_in_a_missing_folder_and_results_that_are_not_a_folder(capsys, tmp_path):
    _one_line_error(
        capsys,
        ["tune", *TINY, "--storage", f"sqlite:///{tmp_path}/missing/s.db", "--results", str(tmp_path)],
        match="does not exist",
    )
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    _one_line_error(
        capsys, ["tune", *TINY, "--results", str(blocker / "results")], match="cannot use the study journal"
    )


def test_sigterm_during_tune_marks_the_trial_interrupted_and_writes_the_table(tmp_path):
    """SIGTERM is handled like Ctrl-C by the real command: exit 130, entry marked incomplete, resumable."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, threading, time
        sys.argv = ["attnbench", "tune", "--model", "tiny-gqa", "--batch", "1", "--context", "64,128,256,512",
                    "--dtype", "fp32", "--repeats", "3", "--results", {str(tmp_path)!r}]
        def later():
            folder = {str(tmp_path)!r}
            while not any(p.name.startswith("tuning-") and p.name.endswith(".yaml") for p in os.scandir(folder)):
                time.sleep(0.05)
            time.sleep(0.5)  # the second key's first candidate: SIGTERM while a trial runs
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=later, daemon=True).start()
        from attnbench.cli import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    env = dict(os.environ, ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "interrupted" in proc.stderr and "Traceback" not in proc.stderr
    from attnbench.tables import ResultsTable

    (path,) = tmp_path.glob("tuning-*.yaml")
    entries = ResultsTable.load(path).typed()
    assert entries and len(entries) < 4  # written up to the interruption, not beyond


def test_tune_names_a_broken_plugin_and_keeps_json_clean(tmp_path):
    site = tmp_path / "site"
    source = "print('half-initialised'); raise ImportError('planted')\n"
    write_fake_dist(
        site, entry="broken", dist="broken-plugin", version="1.0", module="broken_plugin", source=source
    )
    env = plugin_env(site, allow="broken")
    argv = [sys.executable, "-m", "attnbench", "tune", *TINY, "--backends", "naive", "--repeats", "3"]
    proc = subprocess.run(
        [*argv, "--results", str(tmp_path), "--json"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)  # the plugin's print went to stderr
    (failure,) = report["plugin_failures"]
    assert "plugin 'broken'" in failure and "planted" in failure and "half-initialised" in proc.stderr
