"""Third-party backend plugins: the entry-point contract, broken plugins, the two switches, a real install.

Fake plugins are distributions written into a temporary directory (a module plus a ``*.dist-info``
with ``METADATA`` and ``entry_points.txt``) and put on ``sys.path``: that is all ``importlib.metadata``
needs to find an entry point, so no pip is involved. The real plugin ``plugins/attnbench-flex`` is
installed with pip (see :func:`flex_site` for where and why).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.fake_plugins import plugin_source, pythonpath, write_fake_dist

from attnbench import Workload, check, load_registry
from attnbench.core.registry import SUPPORTED_PLUGIN_API, Registry
from attnbench.tables.margin import NEAR_ENOUGH, Interval, decide
from attnbench.tuning.summary import candidate_label

ROOT = Path(__file__).resolve().parents[2]
FLEX_SRC = ROOT / "plugins" / "attnbench-flex"
XFORMERS_SRC = ROOT / "plugins" / "attnbench-xformers"
GUIDE = ROOT / "docs" / "writing-a-backend.md"

GOOD = plugin_source(
    "FakeGoodBackend",
    "fake_good",
    body='description = "a well-behaved plugin backend (naive under another name)"',
)

BOOM = """
raise RuntimeError("boom: this plugin fails while importing")
"""

FUTURE = plugin_source("FutureBackend", "future", api=99)

TAKEN = plugin_source("MyNaive", "naive")  # the name is already registered by the built-in

# the name is already registered by the plugin 'fake_good' (entry points load in name order)
TWIN = plugin_source("Twin", "fake_good")

NO_HOOK = """
ATTNBENCH_PLUGIN_API = 1
"""

NOT_A_BACKEND = """
import attnbench

ATTNBENCH_PLUGIN_API = 1


@attnbench.hookimpl
def attnbench_backends():
    return [dict]
"""

# (entry-point name, distribution, version, module name, module source)
FAKES = [
    ("fake_good", "fake-good", "1.0", "fake_good_plugin", GOOD),
    ("boom", "fake-boom", "0.3", "fake_boom_plugin", BOOM),
    ("future", "fake-future", "2.0", "fake_future_plugin", FUTURE),
    ("taken", "fake-taken", "0.5", "fake_taken_plugin", TAKEN),
    ("zz_twin", "fake-twin", "0.1", "fake_twin_plugin", TWIN),
    ("nohook", "fake-nohook", "0.2", "fake_nohook_plugin", NO_HOOK),
    ("notbackend", "fake-notbackend", "0.4", "fake_notbackend_plugin", NOT_A_BACKEND),
]


@pytest.fixture(scope="module")
def _fake_site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of fake plugins for the module: the registry bounds each plugin's first import in a
    child process and remembers the module file's size and mtime, so an unchanged folder is checked
    once, not once per test (each check imports torch: about 2 s a plugin)."""
    site = tmp_path_factory.mktemp("fake-plugins") / "site"
    for entry, dist, version, module, source in FAKES:
        write_fake_dist(site, entry=entry, dist=dist, version=version, module=module, source=source)
    return site


@pytest.fixture
def fake_site(_fake_site_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """All fake plugins on ``sys.path`` (in-process), each module as :data:`FAKES` writes it (a test
    that changed one gets it back); their modules are forgotten afterwards."""
    site = _fake_site_dir
    for *_, module, source in FAKES:
        path = site / f"{module}.py"
        if path.read_text() != textwrap.dedent(source):
            path.write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(site))
    yield site
    for *_, module, _ in FAKES:
        sys.modules.pop(module, None)


def _failures(reg: Registry) -> dict[str, object]:
    return {f.plugin: f for f in reg.failures}


def _fake_only(reg: Registry) -> dict[str, object]:
    fakes = {entry for entry, *_ in FAKES}
    return {name: f for name, f in _failures(reg).items() if name in fakes}


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "attnbench", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )


# -- broken plugins are reported, everything else keeps working ------------------------------------------


def test_each_broken_plugin_is_reported_with_its_error(fake_site: Path) -> None:
    reg = load_registry(env={})
    fails = _fake_only(reg)
    assert set(fails) == {"boom", "future", "taken", "zz_twin", "nohook", "notbackend"}, reg.failures

    boom = fails["boom"]
    assert (boom.stage, boom.distribution, boom.version) == ("import", "fake-boom", "0.3")
    assert "RuntimeError: boom: this plugin fails while importing" in boom.error
    assert "fake_boom_plugin" in boom.error and "Traceback" in boom.detail

    future = fails["future"]
    lo, hi = SUPPORTED_PLUGIN_API
    supported = f"{lo}..{hi}"
    assert future.stage == "api-version"
    # the message names the plugin, its version, the API it declares and the supported range
    for part in (
        "plugin 'future' (fake-future 2.0)",
        "ATTNBENCH_PLUGIN_API = 99",
        f"supports {supported}:",
    ):
        assert part in future.error, future.error
    assert "future" not in reg

    taken = fails["taken"]
    assert taken.stage == "register"
    assert "'naive'" in taken.error and "built-in" in taken.error and "fake-taken 0.5" in taken.error

    twin = fails["zz_twin"]
    assert "'fake_good'" in twin.error
    assert (
        "plugin 'zz_twin' (fake-twin 0.1)" in twin.error
        and "plugin 'fake_good' (fake-good 1.0)" in twin.error
    )

    assert "implements no attnbench_backends hook" in fails["nohook"].error
    assert "not a subclass of attnbench.Backend" in fails["notbackend"].error


def test_everything_else_keeps_working(fake_site: Path) -> None:
    reg = load_registry(env={})
    assert {"naive", "flash", "fake_good"} <= set(reg.names())
    assert reg.entry("naive").source.kind == "builtin"  # the built-in kept its name
    src = reg.entry("fake_good").source
    assert (src.kind, src.plugin, src.distribution, src.version) == (
        "plugin",
        "fake_good",
        "fake-good",
        "1.0",
    )
    workload = Workload.uniform("tiny-gqa", batch=2, context=17, dtype="fp32")
    for name in ("naive", "fake_good"):
        result = check(reg.get(name), workload)
        assert result.passed, result.summary()


def test_unsupported_api_of_a_backend_class_is_refused(fake_site: Path) -> None:
    (fake_site / "fake_good_plugin.py").write_text(
        textwrap.dedent(GOOD).replace('name = "fake_good"', 'name = "fake_good"\n    plugin_api = 7')
    )
    reg = load_registry(env={"ATTNBENCH_PLUGINS": "fake_good"})
    (failure,) = reg.failures
    assert failure.stage == "api-version" and "declares plugin_api 7" in failure.error
    assert "supports 1..1" in failure.error and "fake_good" not in reg


def test_cli_lists_broken_plugins_and_still_works(fake_site: Path) -> None:
    env = {"PYTHONPATH": pythonpath(fake_site)}
    res = run_cli("backends", "--json", env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    names = {row["name"]: row for row in data["backends"]}
    assert {"naive", "flash", "fake_good"} <= set(names)
    assert names["fake_good"]["distribution"] == "fake-good" and names["fake_good"]["version"] == "1.0"
    broken = {b["plugin"]: b for b in data["broken_plugins"]}
    assert {"boom", "future", "taken", "zz_twin"} <= set(broken)
    assert broken["future"]["stage"] == "api-version" and "fake-future 2.0" in broken["future"]["error"]

    res = run_cli("backends", "--model", "tiny-gqa", "--dtype", "fp32", env=env)
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())  # rich wraps long lines; compare on whitespace-normalised text
    assert "broken plugin 'boom' (fake-boom 0.3) failed at import" in out
    assert "broken plugin 'future' (fake-future 2.0) failed at api-version" in out
    assert "broken plugin 'taken' (fake-taken 0.5) failed at register" in out
    assert "fake_good" in out and "plugin 'fake_good' (fake-good 1.0)" in out


# -- ATTNBENCH_PLUGINS and ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD ---------------------------------------------


@pytest.mark.parametrize("allow", ["fake_good", "fake-good", "Fake_Good", " fake_good , "])
def test_allow_list_loads_only_the_named_plugins(fake_site: Path, allow: str) -> None:
    reg = load_registry(env={"ATTNBENCH_PLUGINS": allow})
    assert "fake_good" in reg and not reg.failures and not reg.unmatched
    assert {"boom", "future", "taken", "zz_twin"} <= set(reg.skipped)
    assert "fake_good" not in reg.skipped


def test_allow_list_by_entry_point_and_distribution_names_and_typos(fake_site: Path) -> None:
    reg = load_registry(env={"ATTNBENCH_PLUGINS": "fake-boom,future,fake_goood"})
    assert set(_fake_only(reg)) == {"boom", "future"}
    assert "fake_good" not in reg and "fake_good" in reg.skipped
    assert reg.unmatched == ["fake_goood"]  # a typo is reported, not silently ignored
    res = run_cli("backends", env={"PYTHONPATH": pythonpath(fake_site), "ATTNBENCH_PLUGINS": "fake_goood"})
    assert res.returncode == 0, res.stderr
    assert "ATTNBENCH_PLUGINS names no installed plugin: fake_goood" in " ".join(res.stdout.split())


def test_empty_allow_list_is_the_same_as_unset(fake_site: Path) -> None:
    reg = load_registry(env={"ATTNBENCH_PLUGINS": " "})
    assert "fake_good" in reg and not reg.skipped


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_disable_autoload_loads_no_plugin(fake_site: Path, value: str) -> None:
    reg = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": value, "ATTNBENCH_PLUGINS": "fake_good"})
    assert reg.autoload_disabled
    assert set(reg.names()) == {
        e.name for e in load_registry(env={}, builtins=True) if e.source.kind == "builtin"
    }
    assert not reg.failures and not reg.skipped  # nothing was even looked at (the switch wins)


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off"])
def test_disable_autoload_off_values(fake_site: Path, value: str) -> None:
    reg = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": value})
    assert not reg.autoload_disabled and "fake_good" in reg


def test_switches_through_the_real_environment(fake_site: Path) -> None:
    """The CLI reads both variables from the process environment."""
    env = {"PYTHONPATH": pythonpath(fake_site), "ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"}
    data = json.loads(run_cli("backends", "--json", env=env).stdout)
    assert data["plugin_autoload_disabled"] is True and data["broken_plugins"] == []
    assert {row["kind"] for row in data["backends"]} == {"builtin"}

    env = {"PYTHONPATH": pythonpath(fake_site), "ATTNBENCH_PLUGINS": "fake_good"}
    data = json.loads(run_cli("backends", "--json", env=env).stdout)
    assert data["broken_plugins"] == [] and "boom" in data["skipped_plugins"]
    assert "fake_good" in {row["name"] for row in data["backends"]}


# -- a real plugin distribution, installed with pip ----------------------------------------------------------


def _build_tools_missing() -> str | None:
    """What the running environment lacks to build a wheel without build isolation (offline)."""
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed"
    import setuptools

    major, minor = (int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return f"setuptools {setuptools.__version__} needs the wheel package to build wheels"
    return None


def pip_install_target(src: Path, work: Path) -> Path:
    """Install the plugin distribution at ``src`` with pip into ``work/site`` (see :func:`flex_site`)."""
    missing = _build_tools_missing()
    if missing:
        pytest.fail(
            f"cannot build a plugin with pip --no-build-isolation: {missing}; install setuptools>=70.1"
        )
    copy = work / src.name
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    cmd += ["--no-cache-dir", "--disable-pip-version-check", "--quiet", "--target", str(site), str(copy)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, f"pip install failed:\n{res.stdout}\n{res.stderr}"
    assert list(site.glob("*.dist-info/entry_points.txt")), sorted(p.name for p in site.iterdir())
    return site


@pytest.fixture(scope="module")
def flex_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``plugins/attnbench-flex`` installed by pip into a fresh ``--target`` directory.

    Why ``--target`` and not the test environment itself: the test must not change the environment
    for the tests that run after it (every later ``load_registry()`` would find the plugin) nor leave
    it changed when the run is interrupted, and it must not need write access to site-packages. The
    install is otherwise the real thing: pip builds a wheel from the plugin's own ``pyproject.toml``
    and writes the package and its ``*.dist-info`` (with ``entry_points.txt``); the tests then run
    ``attnbench`` in subprocesses with the directory on ``PYTHONPATH``, so the core finds the plugin
    only through ``importlib.metadata``. The source is copied first because pip builds in-tree and
    would leave ``build/`` and ``*.egg-info`` in the repository. ``--no-deps --no-build-isolation
    --no-index``: nothing is downloaded; attnbench, torch and setuptools come from the running
    environment.
    """
    return pip_install_target(FLEX_SRC, tmp_path_factory.mktemp("flex"))


def run_plugin_tests(root: Path, site: Path, *, timeout: float) -> subprocess.CompletedProcess:
    """A plugin's own tests, ``root/tests``, run by pytest in a subprocess with ``site`` on the path."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "--rootdir", str(root)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath(site)},
        cwd=root,
        timeout=timeout,
        check=False,
    )


def test_installed_flex_plugin_appears_in_backends(flex_site: Path) -> None:
    env = {"PYTHONPATH": pythonpath(flex_site)}
    res = run_cli("backends", "--model", "tiny-gqa", "--dtype", "fp32", "--json", env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert "flex" in rows, data
    flex = rows["flex"]
    assert (flex["kind"], flex["plugin"], flex["distribution"], flex["version"]) == (
        "plugin",
        "flex",
        "attnbench-flex",
        "0.1.0",
    )
    assert flex["runnable"] is True, flex["reasons"]
    assert flex["implementation"] == f"torch.compile(flex_attention)[{'cpu'}]"
    assert not [b for b in data["broken_plugins"] if b["plugin"] == "flex"]
    # the core found the installed copy, not the source tree
    where = subprocess.run(
        [sys.executable, "-c", "import attnbench_flex; print(attnbench_flex.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(flex_site), where
    # without the directory on the path there is no flex backend: nothing in the core names it (unless
    # someone installed the plugin into this environment, as its README shows)
    try:
        importlib.metadata.distribution("attnbench-flex")
    except importlib.metadata.PackageNotFoundError:
        assert "flex" not in load_registry(env={})


def test_installed_flex_plugin_passes_the_conformance_suite(flex_site: Path, tmp_path: Path) -> None:
    """The plugin's own tests (the conformance suite in a few lines), run against the installed copy."""
    shutil.copytree(FLEX_SRC / "tests", tmp_path / "tests")
    res = run_plugin_tests(tmp_path, flex_site, timeout=1500)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and "failed" not in res.stdout and "skipped" not in res.stdout, tail


def test_flex_unavailable_reason_on_a_device_it_cannot_use(flex_site: Path) -> None:
    env = {"PYTHONPATH": pythonpath(flex_site)}
    res = run_cli("backends", "--model", "tiny-gqa", "--device", "meta", "--json", env=env)
    assert res.returncode == 0, res.stderr
    flex = {row["name"]: row for row in json.loads(res.stdout)["backends"]}["flex"]
    assert flex["runnable"] is False and any("meta" in r for r in flex["reasons"])


def test_cuda_flex(flex_site: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (the CPU path is tested above)")
    env = {"PYTHONPATH": pythonpath(flex_site)}
    res = run_cli("backends", "--model", "tiny-gqa", "--device", "cuda", "--json", env=env)
    flex = {row["name"]: row for row in json.loads(res.stdout)["backends"]}["flex"]
    assert flex["runnable"] is True, flex["reasons"]


def test_installed_flex_plugin_takes_part_in_tune(flex_site: Path, tmp_path: Path) -> None:
    """A small ``attnbench tune``: every flex config is checked, timed in a worker, and decided by the margin policy."""
    args = ["tune", "--model", "tiny-gqa", "--batch", "2", "--context", "256", "--dtype", "fp32"]
    args += ["--backends", "naive,flex", "--results", str(tmp_path), "--repeats", "3", "--max-seconds", "2"]
    args += [
        "--timeout",
        "600",
    ]  # a worker's first flex candidate compiles; a cold compile on a busy CPU is slow
    res = run_cli(*args, "--json", env={"PYTHONPATH": pythonpath(flex_site)}, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)
    (entry,) = data["entries"].values()
    flex = [c for c in entry["candidates"] if c["backend"] == "flex"]
    assert sorted(c["config"]["block_size"] for c in flex) == [64, 128, 256], entry["candidates"]
    for c in flex:  # passed the correctness gate and was timed
        assert "failed" not in c and c["step_ms"] > 0, c
        assert c["implementation"] == "torch.compile(flex_attention)[cpu]"
    # the winner is the one margin policy's verdict over the re-timed finalists' intervals: the
    # fastest only when it beats the default by the switch margin beyond both intervals, else a tie
    timed = {candidate_label(c): Interval(**c["interval"]) for c in entry["candidates"] if "interval" in c}
    default = candidate_label(entry["default"])
    study = [c.get("study_ms") or c["step_ms"] for c in entry["candidates"] if c.get("step_ms")]
    # at least three finalists, of those within NEAR_ENOUGH × the best's study time (a config whose
    # study step spiked far beyond it is no finalist to make three: attnbench.tables.margin.finalists)
    near = [t for t in study if t <= NEAR_ENOUGH * min(study)]
    assert len(timed) >= min(3, len(near)) and len(timed) >= 2, entry["candidates"]
    if default not in timed:  # more than DEFAULT_RETIMED_WITHIN × the best by its study: not re-timed
        from attnbench.tuning.tuner import DEFAULT_RETIMED_WITHIN

        assert entry["default"]["step_ms"] > DEFAULT_RETIMED_WITHIN * min(study), entry["candidates"]
    verdict = decide(timed, default=default if default in timed else None, margin=entry["switch_margin"])
    assert candidate_label(entry["winner"]) == verdict.winner and entry["tie"] == verdict.tie, entry
    table = Path(data["table"]).read_text()
    assert "flex" in table


@pytest.fixture(scope="module")
def xformers_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install_target(XFORMERS_SRC, tmp_path_factory.mktemp("xformers"))


def test_installed_xformers_plugin_is_listed_with_xformers_own_reason(xformers_site: Path) -> None:
    env = {"PYTHONPATH": pythonpath(xformers_site)}
    res = run_cli("backends", "--model", "tiny-gqa", "--json", env=env)
    assert res.returncode == 0, res.stderr
    rows = {row["name"]: row for row in json.loads(res.stdout)["backends"]}
    row = rows["xformers"]
    assert (row["kind"], row["distribution"], row["version"]) == ("plugin", "attnbench-xformers", "0.1.0")
    probe = subprocess.run(
        [sys.executable, "-c", "import xformers.ops"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:  # xformers missing here: the reason is its import error, verbatim
        last = probe.stderr.strip().splitlines()[-1]  # e.g. "ModuleNotFoundError: No module named 'xformers'"
        assert row["runnable"] is False and row["reasons"] == [f"xformers not importable ({last})"], row
    elif not torch.cuda.is_available():
        assert row["runnable"] is False and row["reasons"][0].startswith("xformers refuses"), row


def test_installed_xformers_plugin_passes_its_own_tests(xformers_site: Path, tmp_path: Path) -> None:
    """The plugin's tests against the installed copy: xformers' reason where it is missing, the CUDA
    conformance class (skipped here with the reason), and the conformance suite over the plugin's
    plumbing with the stand-in for xformers."""
    shutil.copytree(XFORMERS_SRC / "tests", tmp_path / "tests")
    res = run_plugin_tests(tmp_path, xformers_site, timeout=900)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0 and "failed" not in res.stdout, tail
    passed = int(re.search(r"(\d+) passed", res.stdout).group(1))  # type: ignore[union-attr]
    assert passed >= 40, tail  # the stand-in conformance class ran


def guide_files() -> dict[str, str]:
    """The files of the guide's example: each block introduced by a line "File `path`:"."""
    text = GUIDE.read_text()
    return dict(re.findall(r"^File `([^`]+)`:\n\n```\w*\n(.*?)^```", text, re.MULTILINE | re.DOTALL))


def test_writing_a_backend_guide_example(tmp_path: Path) -> None:
    """docs/writing-a-backend.md, followed literally: install, conformance suite, `attnbench backends`."""
    files = guide_files()
    assert set(files) == {
        "pyproject.toml",
        "src/attnbench_mysdpa/__init__.py",
        "src/attnbench_mysdpa/backend.py",
        "tests/test_mysdpa.py",
    }, sorted(files)
    src = tmp_path / "attnbench-mysdpa"
    for rel, body in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(body)
    (tmp_path / "install").mkdir()
    site = pip_install_target(src, tmp_path / "install")
    res = run_plugin_tests(src, site, timeout=900)
    assert res.returncode == 0 and " passed" in res.stdout and "failed" not in res.stdout, res.stdout[-3000:]
    res = run_cli("backends", "--model", "tiny-gqa", "--json", env={"PYTHONPATH": pythonpath(site)})
    row = {r["name"]: r for r in json.loads(res.stdout)["backends"]}["mysdpa"]
    assert (row["source"], row["runnable"]) == ("plugin 'mysdpa' (attnbench-mysdpa 0.1.0)", True), row
