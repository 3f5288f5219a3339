#!/usr/bin/env bash
# CI check of the install paths a user takes (README's first programs), on a scratch prefix:
#  1. packaging/install.sh with --destdir, then used from another directory (relocated): the
#     library's SONAME is librefit.so.<abi> and resolves through the installed symlinks;
#  2. examples/c/first.c built with pkg-config and run;
#  3. examples/cpp built with CMake's find_package(refit) and run;
#  4. `pip install ./python` into a fresh virtual environment, then examples/python/first.py and the
#     integration shim run from outside the repository with no REFIT_LIBRARY.
# Installs cmake and pkg-config from Debian when missing. Uses the debug library `cargo test` built
# (REFIT_CARGO_PROFILE=debug) so nothing is compiled twice.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v pkg-config >/dev/null || need+=(pkg-config)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cargo build --package refit --lib --quiet
abi=$(sed -n 's/^#define REFIT_ABI_VERSION \([0-9]*\)$/\1/p' include/refit.h)

echo "--- install (staged under a destdir, then used from where it was moved)"
packaging/install.sh --prefix /opt/refit --destdir "$scratch/stage" --library target/debug/librefit.so
mv "$scratch/stage/opt/refit" "$scratch/refit"
prefix=$scratch/refit
soname=$(readelf -d "$prefix/lib/librefit.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "librefit.so.$abi" ] || { echo "SONAME is '$soname', expected librefit.so.$abi"; exit 1; }
[ "$(readlink "$prefix/lib/librefit.so")" = "librefit.so.$abi" ] || { echo "librefit.so link wrong"; exit 1; }

echo "--- C with pkg-config"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
flags=$(pkg-config --cflags --libs refit)
cc -std=c11 -Wall -Wextra -Werror examples/c/first.c $flags -Wl,-rpath,"$prefix/lib" -o "$scratch/first_c"
readelf -d "$scratch/first_c" | grep -q "NEEDED.*\[librefit.so.$abi\]" || { echo "first_c does not need librefit.so.$abi"; exit 1; }
"$scratch/first_c"

echo "--- C++ with CMake find_package(refit)"
cmake -S examples/cpp -B "$scratch/build_cpp" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$scratch/build_cpp" >/dev/null
"$scratch/build_cpp/first"

echo "--- Python: pip install ./python into a fresh virtual environment"
python3 -m venv "$scratch/venv"
REFIT_CARGO_PROFILE=debug "$scratch/venv/bin/pip" install --quiet --disable-pip-version-check ./python
(
  cd "$scratch"
  unset REFIT_LIBRARY PYTHONPATH
  "$scratch/venv/bin/python" -c 'import refit, pathlib; assert pathlib.Path(refit.lib._name).parent == pathlib.Path(refit.__file__).parent, refit.lib._name'
  "$scratch/venv/bin/python" "$root/examples/python/first.py"
  "$scratch/venv/bin/python" "$root/examples/python/shim.py"
)
echo "packaging check passed"
