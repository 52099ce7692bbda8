"""The `kvpeer` package's build backend: maturin's, behind a check that Rust is there.

pip calls these PEP 517 hooks in its build environment. Without `cargo` on PATH, maturin would
quietly download and install a Rust toolchain (about 770 MB, through `puccinialin`) before
building; kvpeer stops at once instead and says what to do. `KVPEER_INSTALL_RUST=1` lets
maturin fetch the toolchain as it would.

Written by hand because no packaging tool offers "require a toolchain" as a setting; it only
delegates, so every hook behaves as maturin's once cargo is found.
"""

import os
import shutil
import sys

NO_RUST = """kvpeer is built from Rust source, and no Rust toolchain (`cargo`) is on PATH.

  * install Rust (https://rustup.rs: `curl https://sh.rustup.rs -sSf | sh`), then pip install again;
  * or install a prebuilt wheel: build it once on a machine with Rust,
      pip wheel --no-deps --wheel-dir wheels /path/to/kvpeer
    and on each engine host `pip install wheels/kvpeer-*.whl` (hosts of the same CPU
    architecture with a glibc as new as the build machine's; one wheel serves CPython 3.10+);
  * or set KVPEER_INSTALL_RUST=1 to let the build download a toolchain (about 770 MB)."""


def _require_rust():
    if os.environ.get("KVPEER_INSTALL_RUST") == "1":
        return
    if shutil.which("cargo") is None:
        # The message alone, no traceback: pip prints the hook's output under its own error.
        sys.exit(NO_RUST)
    # maturin looks for cargo itself; with it found it never fetches a toolchain.


def _maturin():
    # Imported when a hook runs, after the check: the check itself needs nothing installed.
    import maturin

    return maturin


def get_requires_for_build_wheel(config_settings=None):
    _require_rust()
    return _maturin().get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _require_rust()
    # maturin's own (an alias of its wheel hook); older maturin has only the wheel hook.
    maturin = _maturin()
    hook = getattr(maturin, "get_requires_for_build_editable", maturin.get_requires_for_build_wheel)
    return hook(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    _require_rust()
    return _maturin().get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _require_rust()
    return _maturin().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _require_rust()
    return _maturin().build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _require_rust()
    return _maturin().build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    _require_rust()
    return _maturin().build_sdist(sdist_directory, config_settings)
