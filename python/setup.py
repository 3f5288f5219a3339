"""Build hook of the refit-gpu distribution: compiles librefit with cargo and ships it inside the
`refit` package, so `import refit` finds it next to its own files with no environment variable.

`pip install ./python` (from a clone of the repository) needs Rust's cargo on PATH; the crate is
the directory above this one. Environment:
  REFIT_CARGO_PROFILE  release (default) or debug: which cargo profile to build and ship
  CARGO_TARGET_DIR     cargo's usual target directory override (default: the crate's target/)
  CARGO                the cargo executable (default: cargo)
The version is the crate's (Cargo.toml), so the wheel and the library it carries always agree.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # older setuptools: the `wheel` package's
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
CRATE = HERE.parent
LIBRARY = "librefit.so"


def crate_version() -> str:
    manifest = CRATE / "Cargo.toml"
    if not manifest.exists():
        raise SystemExit(
            f"refit-gpu: {manifest} not found. Build from a clone of the refit repository "
            "(pip install ./python), which holds the Rust crate this package compiles."
        )
    match = re.search(r'^version\s*=\s*"([^"]+)"', manifest.read_text(), re.MULTILINE)
    if not match:
        raise SystemExit(f"refit-gpu: no version in {manifest}")
    return match.group(1)


def build_library() -> Path:
    """Runs cargo and returns the path of the library it built."""
    profile = os.environ.get("REFIT_CARGO_PROFILE", "release")
    if profile not in ("release", "debug"):
        raise SystemExit(f"refit-gpu: REFIT_CARGO_PROFILE={profile!r}; use release or debug")
    cargo = os.environ.get("CARGO", "cargo")
    if shutil.which(cargo) is None:
        raise SystemExit(
            f"refit-gpu: '{cargo}' not found on PATH. Building this package compiles librefit from its "
            "Rust sources: install Rust (https://rustup.rs, or your distribution's cargo; the crate needs "
            "the rust-version in Cargo.toml or newer) and run pip again."
        )
    command = [cargo, "build", "--package", "refit", "--lib", "--manifest-path", str(CRATE / "Cargo.toml")]
    if profile == "release":
        command.append("--release")
    print("refit-gpu: " + " ".join(command), flush=True)
    subprocess.run(command, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", CRATE / "target"))
    if not target.is_absolute():
        target = CRATE / target
    built = target / profile / LIBRARY
    if not built.exists():
        raise SystemExit(f"refit-gpu: cargo finished but {built} does not exist")
    return built


class BuildPyWithLibrary(build_py):
    """build_py, then the library copied into the built `refit` package."""

    def run(self) -> None:
        super().run()
        destination = Path(self.build_lib) / "refit" / LIBRARY
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(build_library(), destination)
        destination.chmod(0o755)


class PlatformWheel(bdist_wheel):
    """The wheel carries a native library, so it is tagged for this platform; it is loaded with
    ctypes, not built against one Python's C API, so one wheel serves every Python 3."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple:
        _python, _abi, platform = super().get_tag()
        return "py3", "none", platform


setup(version=crate_version(), cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel})
