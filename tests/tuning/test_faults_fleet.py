"""A fleet on a real PostgreSQL: three ``attnbench tune`` processes, one study, one tuner killed.

Three tuners, each with its own host id, start at once on one fresh database (the schema is created
by whichever wins the advisory lock). One is killed with SIGKILL while its candidate runs and is
restarted. Its trial's heartbeat stops, so a tuner fails it without a verdict and its candidate runs
again. Afterwards every candidate has exactly one verdict (never two COMPLETE trials), none is lost,
each tuner's table is complete, and ``select()`` answers from it.

PostgreSQL comes from ``$ATTNBENCH_TEST_POSTGRES`` (set by ``scripts/test.sh``, the project's test
command), else from a private server started here with ``scripts/postgres.sh`` when the binaries
are installed; the test is skipped, with the reason, only where neither is possible.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTEXTS = ("2k", "4k", "8k")  # three keys, two candidates each
ARGS = ["--model", "tiny-gqa", "--batch", "1", "--context", ",".join(CONTEXTS), "--dtype", "fp32"]
BACKENDS = "naive,flash"


def _start_private_server(tmp: Path) -> str:
    script = ROOT / "scripts" / "postgres.sh"
    proc = subprocess.run(["bash", str(script), "start", str(tmp)], capture_output=True, text=True)
    if proc.returncode == 3:
        pytest.skip(f"PostgreSQL cannot be had here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def postgres_url(tmp_path_factory):
    pytest.importorskip("psycopg", reason="the postgres extra (psycopg 3) is not installed")
    url = os.environ.get("ATTNBENCH_TEST_POSTGRES")
    if url:
        yield url
        return
    if os.environ.get("ATTNBENCH_TEST_POSTGRES_UNAVAILABLE"):
        pytest.skip(os.environ["ATTNBENCH_TEST_POSTGRES_UNAVAILABLE"])
    if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")) and not shutil.which("initdb"):
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql, or run bash scripts/test.sh)")
    tmp = tmp_path_factory.mktemp("pg")
    url = _start_private_server(tmp)
    try:
        yield url
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / "postgres.sh"), "stop", str(tmp)], check=False)


@pytest.fixture
def fresh_database(postgres_url):
    import psycopg

    name = f"fleet_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = postgres_url.rpartition("/")
    yield f"{base}/{name}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _tuner(url: str, host: str, results: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "attnbench", "tune", *ARGS, "--backends", BACKENDS, "--storage", url]
    cmd += ["--host-id", host, "--heartbeat", "1", "--repeats", "20", "--timeout", "120"]
    cmd += ["--results", str(results), "--json"]
    log = open(results.with_suffix(".log"), "ab")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _states(url: str) -> tuple[dict[str, int], list]:
    import optuna

    trials = []  # (study name, trial)
    for summary in optuna.get_all_study_summaries(url):
        study = optuna.load_study(study_name=summary.study_name, storage=url)
        trials += [(summary.study_name, t) for t in study.get_trials(deepcopy=False)]
    return dict(collections.Counter(t.state.name for _, t in trials)), trials


def test_a_fleet_of_three_tuners_survives_a_sigkill(fresh_database, tmp_path, capsys):
    import optuna

    from attnbench.core.device import load_profile

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    load_profile("cpu")  # measured once here (cached), not three times at once by the tuners
    env = dict(os.environ, ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD="1")
    url = fresh_database
    results = {h: tmp_path / h for h in ("fleet-a", "fleet-b", "fleet-c")}
    procs = {h: _tuner(url, h, r, env) for h, r in results.items()}  # all at once: a fresh database

    deadline = time.monotonic() + 240
    killed = None  # (host, study, trial number): the first tuner seen inside a candidate is killed
    while killed is None:
        assert time.monotonic() < deadline, "no tuner ran a candidate"
        assert all(p.poll() is None for p in procs.values()), "a tuner finished before one was killed"
        try:
            _, trials = _states(url)
        except Exception:  # the schema is being created
            time.sleep(0.2)
            continue
        running = [
            (n, t)
            for n, t in trials
            if t.state.name == "RUNNING" and {"backend", "host"} <= set(t.user_attrs)
        ]  # a trial writes its attributes one by one: wait until it names its host
        before = dict(collections.Counter(t.state.name for _, t in trials))  # the moment before the kill
        if running:
            victim = running[0][1].user_attrs["host"]
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait()
            _, trials = _states(url)  # what the dead tuner left running (its candidate may have ended)
            left = [
                (n, t) for n, t in trials if t.state.name == "RUNNING" and t.user_attrs.get("host") == victim
            ]
            if not left:  # killed between two trials: no abandoned trial to prove anything with
                procs[victim] = _tuner(url, victim, results[victim], env)
                continue
            killed = (victim, left[0][0], left[0][1].number)
        time.sleep(0.1)
    at_kill, _ = _states(url)
    with capsys.disabled():
        print(f"\nfleet: trials per state before the SIGKILL of {victim}: {before}", flush=True)
        print(f"fleet: right after it (the dead tuner's trial still RUNNING): {at_kill}", flush=True)

    procs[victim] = _tuner(url, victim, results[victim], env)  # restarted with the same host id
    for host, proc in procs.items():
        assert proc.wait(timeout=300) == 0, results[host].with_suffix(".log").read_text()[-3000:]
    after, trials = _states(url)
    with capsys.disabled():
        print(f"fleet: trials per state after the restart and the end: {after}", flush=True)

    # the killed trial was failed by its stopped heartbeat (no verdict), not by a PID check
    dead = next(t for n, t in trials if (t.user_attrs.get("host"), n, t.number) == killed)
    assert dead.state.name == "FAIL" and "kind" not in dead.user_attrs, dead
    with capsys.disabled():
        print(
            f"fleet: the killed trial {killed} ended {dead.state.name} by its stopped heartbeat", flush=True
        )
    # every candidate: exactly one verdict; never two COMPLETE trials for one candidate
    verdicts: dict[tuple, list] = collections.defaultdict(list)
    for study, t in trials:
        if "backend" not in t.user_attrs or "duplicate_of" in t.user_attrs:
            continue
        ident = (study, t.user_attrs["backend"], tuple(sorted(t.user_attrs["config"].items())))
        kind = t.user_attrs.get("kind")
        # a failure with its kind, or a candidate the pruner stopped after it passed the gate
        verdict = (t.state.name == "FAIL" and kind not in (None, "ok", "interrupted")) or (
            t.state.name == "PRUNED" and kind == "pruned"
        )
        if t.state.name == "COMPLETE" or verdict:
            verdicts[ident].append(t.state.name)
    assert all(len(v) == 1 for v in verdicts.values()), verdicts
    completes = collections.Counter(
        (n, t.user_attrs["backend"], tuple(sorted(t.user_attrs["config"].items())))
        for n, t in trials
        if t.state.name == "COMPLETE"
    )
    assert max(completes.values()) == 1, completes

    from attnbench import select
    from attnbench.tables import ResultsTable

    for host, folder in results.items():
        (table_file,) = folder.glob("tuning-*.yaml")
        entries = list(ResultsTable.load(table_file).typed().values())
        assert len(entries) == len(CONTEXTS), host
        for entry in entries:
            assert entry.complete and entry.trials == entry.space_size, (host, entry)
            measured = {(entry.study, c.backend, tuple(sorted(c.config.items()))) for c in entry.candidates}
            assert measured == {v for v in verdicts if v[0] == entry.study}, (host, entry.study)
        assert len(verdicts) == sum(e.space_size for e in entries)  # none lost
    for context in CONTEXTS:
        choice = select(model="tiny-gqa", batch=1, context=context, dtype="fp32", results_dir=results[victim])
        assert choice.source == "tuned" and choice.backend in BACKENDS.split(","), choice
