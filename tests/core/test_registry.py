"""Registry behaviour at the unit level (entry points faked); tests/core/test_plugins.py installs real ones."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
from helpers.fake_plugins import plugin_source

import attnbench.core.registry as registry_mod
from attnbench.core.registry import RegistryError, load_registry

NO_PLUGINS = {"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_builtins_registered_through_the_hook() -> None:
    reg = load_registry(env=NO_PLUGINS)
    assert {"naive", "flash"} <= set(reg.names())
    assert reg.entry("naive").source.kind == "builtin"
    impls = reg.manager.hook.attnbench_backends.get_hookimpls()
    assert [i.plugin_name for i in impls] == ["builtin"]


def test_unknown_name_lists_registered() -> None:
    reg = load_registry(env=NO_PLUGINS)
    with pytest.raises(RegistryError, match=r"unknown backend 'flsh'; registered: naive, flash"):
        reg.get("flsh")


def _fake_plugins(monkeypatch, tmp_path, modules: dict[str, str]) -> None:
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint(name, name, registry_mod.ENTRY_POINT_GROUP) for name in modules]
    monkeypatch.setattr(
        registry_mod, "entry_points", lambda group: eps if group == registry_mod.ENTRY_POINT_GROUP else []
    )


GOOD = plugin_source("Good", "good_plugin")


def test_plugin_raising_on_import_is_listed_broken(monkeypatch, tmp_path) -> None:
    _fake_plugins(
        monkeypatch, tmp_path, {"ab_broken_import": "raise RuntimeError('boom at import')", "ab_good": GOOD}
    )
    reg = load_registry(env={})
    assert {"naive", "flash", "good_plugin"} <= set(reg.names())
    (failure,) = reg.failures
    assert failure.plugin == "ab_broken_import" and failure.stage == "import"
    assert "RuntimeError: boom at import" in failure.error
    reg.get("naive")  # the built-ins still work


def test_duplicate_name_names_both_sources(monkeypatch, tmp_path) -> None:
    _fake_plugins(monkeypatch, tmp_path, {"ab_dup": plugin_source("Good", "naive")})
    reg = load_registry(env={})
    (failure,) = reg.failures
    assert "'naive'" in failure.error and "plugin 'ab_dup'" in failure.error and "built-in" in failure.error
    assert reg.entry("naive").source.kind == "builtin"


def test_unsupported_api_version(monkeypatch, tmp_path) -> None:
    _fake_plugins(
        monkeypatch,
        tmp_path,
        {"ab_future": plugin_source("Good", "good_plugin", api=99)},
    )
    reg = load_registry(env={})
    (failure,) = reg.failures
    assert failure.stage == "api-version" and "99" in failure.error and "supports 1..1" in failure.error
    assert "good_plugin" not in reg


def test_env_switches(monkeypatch, tmp_path) -> None:
    _fake_plugins(monkeypatch, tmp_path, {"ab_good": GOOD, "ab_other": plugin_source("Good", "other_plugin")})
    assert "good_plugin" not in load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    reg = load_registry(env={"ATTNBENCH_PLUGINS": "ab_other"})
    assert "other_plugin" in reg and "good_plugin" not in reg and reg.skipped == ["ab_good"]
    assert {"good_plugin", "other_plugin"} <= set(load_registry(env={}).names())


def test_one_protocol_style_hooks_read_from_an_overridden_resolve() -> None:
    """A backend that answers in ``resolve()`` gets hooks that read from it; one that later overrides a
    hook without ``resolve()`` is refused at class creation (its hook would disagree with resolve)."""

    import pytest

    from attnbench.core.backend import Backend
    from attnbench.core.workload import Workload

    class OnePass(Backend):
        name = "one_pass"

        def resolve(self, workload, config=None):
            return self.resolution(workload, config, reasons=["only on Tuesdays"], implementation="x")

        def create_cache(self, *a, **k):  # pragma: no cover - never run
            raise NotImplementedError

        def plan(self, *a, **k):  # pragma: no cover
            raise NotImplementedError

        def decode(self, *a, **k):  # pragma: no cover
            raise NotImplementedError

    w = Workload.uniform("tiny-gqa", batch=1, context=16)
    b = OnePass()
    assert b.supports(w) == ["only on Tuesdays"]
    assert b.implementation(w) == "unavailable: only on Tuesdays" and b.tunables_for(w) == ()
    with pytest.raises(TypeError, match="override resolve"):

        class Disagrees(OnePass):
            def supports(self, workload):
                return []


def test_the_code_hash_covers_a_backends_code_files(tmp_path) -> None:
    """A backend's code hash changes with the files it names in ``code_files`` (a compiled kernel's
    sources), by file name and content: the same tree elsewhere hashes alike."""
    from attnbench.backends.cpu_decode import CpuDecodeBackend
    from attnbench.backends.naive import NaiveBackend
    from attnbench.core.registry import code_hash

    kernel = tmp_path / "a" / "kernel.c"
    kernel.parent.mkdir()
    kernel.write_text("int f(void) { return 1; }\n")

    class Compiled(NaiveBackend):
        name = "compiled_planted"
        code_files = (str(kernel),)

    before = code_hash([Compiled])
    kernel.write_text("int f(void) { return 2; }\n")
    assert code_hash([Compiled]) != before
    elsewhere = tmp_path / "b" / "kernel.c"
    elsewhere.parent.mkdir()
    elsewhere.write_text("int f(void) { return 2; }\n")
    Compiled.code_files = (str(elsewhere),)
    assert code_hash([Compiled]) == code_hash([Compiled])  # stable
    moved = code_hash([Compiled])
    Compiled.code_files = (str(kernel),)
    assert code_hash([Compiled]) == moved  # same name and bytes, another folder: the same hash
    assert any(f.endswith("cpu_decode.c") for f in CpuDecodeBackend.code_files)
