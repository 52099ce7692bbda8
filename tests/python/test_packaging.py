"""Installing kvpeer from source: without a Rust toolchain, `pip` stops at once with what to do
(build_backend/kvpeer_build.py) instead of downloading one; with one, maturin builds as before
(scripts/test.sh builds the wheel through the same backend)."""

import importlib.util
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).parents[2]


def backend():
    spec = importlib.util.spec_from_file_location("kvpeer_build", REPO / "build_backend" / "kvpeer_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def path_without_cargo(tmp_path) -> str:
    """A PATH holding only this Python: no `cargo`, wherever the machine keeps its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "python").exists():
        (bin_dir / "python").symlink_to(sys.executable)
    return str(bin_dir)


def test_pip_without_rust_stops_at_once_and_says_what_to_do(tmp_path):
    env = {"HOME": str(tmp_path), "PATH": path_without_cargo(tmp_path), "PIP_NO_INPUT": "1"}
    assert shutil.which("cargo", path=env["PATH"]) is None
    out = tmp_path / "wheels"
    # No build isolation: nothing is fetched, and the backend's first hook is the check.
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--wheel-dir", str(out), str(REPO)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    said = run.stdout + run.stderr
    assert run.returncode != 0, said
    assert "no Rust toolchain (`cargo`) is on PATH" in said, said
    assert "https://rustup.rs" in said and "pip wheel --no-deps --wheel-dir wheels" in said, said
    assert "puccinialin" not in said, said
    assert not out.exists() or not any(out.iterdir())


HOOKS = {
    "get_requires_for_build_wheel": (),
    "get_requires_for_build_editable": (),
    "get_requires_for_build_sdist": (),
    "prepare_metadata_for_build_wheel": ("metadata",),
    "build_wheel": ("wheels",),
    "build_editable": ("wheels",),
    "build_sdist": ("sdist",),
}


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_every_hook_checks_before_maturin_runs(monkeypatch, tmp_path, hook):
    monkeypatch.setenv("PATH", path_without_cargo(tmp_path))
    monkeypatch.delenv("KVPEER_INSTALL_RUST", raising=False)
    # maturin itself is never reached: a stand-in that fails loudly if it is.
    monkeypatch.setitem(sys.modules, "maturin", None)
    args = [str(tmp_path / a) for a in HOOKS[hook]]
    with pytest.raises(SystemExit) as stopped:
        getattr(backend(), hook)(*args)
    assert "no Rust toolchain" in str(stopped.value.code)


def test_the_backend_offers_every_hook_maturin_does():
    # PEP 517/660's hooks that pip calls: each is the backend's, so none falls back to a
    # default that skips the check.
    module = backend()
    assert all(callable(getattr(module, hook, None)) for hook in HOOKS)


def test_with_cargo_or_consent_the_hooks_are_maturins(monkeypatch, tmp_path):
    calls = []

    class FakeMaturin:
        @staticmethod
        def get_requires_for_build_wheel(config_settings=None):
            calls.append(config_settings)
            return ["from-maturin"]

    monkeypatch.setitem(sys.modules, "maturin", FakeMaturin)
    monkeypatch.delenv("KVPEER_INSTALL_RUST", raising=False)
    # A cargo on PATH: maturin's hook runs, with the settings passed through.
    cargo_dir = tmp_path / "cargo-bin"
    cargo_dir.mkdir()
    (cargo_dir / "cargo").write_text("#!/bin/sh\n")
    (cargo_dir / "cargo").chmod(0o755)
    monkeypatch.setenv("PATH", str(cargo_dir))
    assert backend().get_requires_for_build_wheel({"k": "v"}) == ["from-maturin"]
    # No cargo, but the user consents to maturin's download.
    monkeypatch.setenv("PATH", path_without_cargo(tmp_path))
    monkeypatch.setenv("KVPEER_INSTALL_RUST", "1")
    assert backend().get_requires_for_build_wheel() == ["from-maturin"]
    assert calls == [{"k": "v"}, None]
