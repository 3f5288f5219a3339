#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, over what gpu/stage.sh put in .gpu/:
#   every GPU test (tests/gpu_*.rs, #[ignore]d elsewhere, run here with --ignored), the Python tests,
#   then every GPU bench (benches/gpu_*), the Python peer benches (benches/*_peer.py),
#   and prints a short table last. Logs and JSON results go to $OUT.
#   `probes` (not part of `all`) builds and runs the probes in benches/probes/ instead: each answered
#   one design question (benches/probes/README.md) and is rerun when that question is reopened.
#   `sanitize` (not part of `all`) runs the GPU tests under compute-sanitizer: memcheck over every
#   test binary, racecheck and synccheck over those whose kernels share memory within a block.
# Usage: gpu/run.sh [tests|benches|demo|probes|sanitize|all] [filter]   (DEMO_ARGS: for the demo)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export REFIT_NCCL_LIBRARY=${REFIT_NCCL_LIBRARY:-/usr/lib/x86_64-linux-gnu/libnccl.so.2}
export REFIT_LIBRARY=$PWD/.gpu/lib/librefit.so
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}
# Only 8 files come back from $OUT: work in $work, pack it into $OUT/gpu.tgz at the end.
work=/tmp/refit-gpu
rm -rf "$work" && mkdir -p "$work"
export REFIT_BENCH_RESULTS=$work/results
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
mkdir -p "$REFIT_BENCH_RESULTS"
what=${1:-all}
filter=${2:-}
log=$work/gpu.log
summary=()

nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$log"
nvidia-smi topo -m 2>&1 | head -5 | tee -a "$log"

record() { summary+=("$(printf '%-34s %s' "$1" "$2")"); }

gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
# Tests named *_two_gpus fail on one GPU by design: skip them by name there and say how many.
skip_args=()
[ "$gpus" -lt 2 ] && skip_args=(--skip _two_gpus)

if [ "$what" = all ] || [ "$what" = tests ]; then
  for t in .gpu/tests/gpu_*; do
    [ -e "$t" ] || continue
    name=$(basename "$t")
    [ -n "$filter" ] && [[ "$name" != *$filter* ]] && continue
    echo "=== test $name" | tee -a "$log"
    skipped=0
    [ ${#skip_args[@]} -gt 0 ] && skipped=$("$t" --ignored --list 2>/dev/null | grep -c '_two_gpus: test')
    if timeout ${REFIT_GPU_TIMEOUT:-300} "$t" --ignored --test-threads=1 "${skip_args[@]}" >>"$log" 2>&1; then
      result=$(grep -E '^test result' "$log" | tail -1)
      [ "$skipped" -gt 0 ] && result="$result; $skipped *_two_gpus NOT run (one GPU)"
      record "$name" "$result"
    else
      record "$name" "FAILED (see gpu.log)"
    fi
  done
  if [ -z "$filter" ] || [[ python == *$filter* ]]; then
    # The Python binding's suite, its torch tests included (they need a GPU; skipped elsewhere).
    echo "=== python tests" | tee -a "$log"
    if timeout ${REFIT_GPU_TIMEOUT:-300} python3 -m unittest discover -v -s python/tests >>"$log" 2>&1; then
      record "python tests" "$(grep -E '^Ran [0-9]+ tests' "$log" | tail -1)"
    else
      record "python tests" "FAILED (see gpu.log)"
    fi
  fi
fi

if [ "$what" = sanitize ]; then
  # A tool's findings fail the run (--error-exitcode); what it printed is in gpu.log. The tool
  # follows the processes a test starts (gpu_comm runs this binary again as its ranks); the Python
  # suite is left out.
  # Failed API calls are not findings here: NCCL's initialization probes kernel images it lacks
  # (cudaErrorNoKernelImageForDevice), and a copy-engine run is first tried whole (a run crossing
  # allocations is CUDA_ERROR_INVALID_VALUE, then split); refit turns every failed call it cares
  # about into a status, which the tests check.
  sanitize() { # tool, test binary, tool options...
    local tool=$1 t=$2 name
    shift 2
    name=$(basename "$t")
    [ -n "$filter" ] && [[ "$name" != *$filter* ]] && return
    echo "=== $tool $name" | tee -a "$log"
    if timeout ${REFIT_GPU_TIMEOUT:-240} compute-sanitizer --tool "$tool" --report-api-errors no \
        --error-exitcode 97 --print-limit 20 "$@" "$t" --ignored --test-threads=1 "${skip_args[@]}" >>"$log" 2>&1; then
      record "$tool $name" "clean: $(grep -E '^test result' "$log" | tail -1 | cut -d' ' -f3-5)"
    else
      record "$tool $name" "FAILED rc=$? (see gpu.log)"
    fi
  }
  for t in .gpu/tests/gpu_*; do
    sanitize memcheck "$t" --leak-check full --target-processes all
  done
  for t in .gpu/tests/gpu_digest .gpu/tests/gpu_copy .gpu/tests/gpu_exec .gpu/tests/gpu_quant; do
    sanitize racecheck "$t"
    sanitize synccheck "$t"
  done
fi

if [ "$what" = all ] || [ "$what" = benches ]; then
  for b in .gpu/benches/gpu_*; do
    [ -e "$b" ] || continue
    name=$(basename "$b")
    [ -n "$filter" ] && [[ "$name" != *$filter* ]] && continue
    echo "=== bench $name" | tee -a "$log"
    if timeout ${REFIT_GPU_TIMEOUT:-300} "$b" 2>&1 | tee -a "$log" "$work/$name.txt" >/dev/null; then
      record "$name" "ok"
    else
      record "$name" "FAILED"
    fi
  done
  for p in benches/*_peer.py; do
    [ -e "$p" ] || continue
    name=$(basename "$p" .py)
    [ -n "$filter" ] && [[ "$name" != *$filter* ]] && continue
    echo "=== python $name" | tee -a "$log"
    if timeout ${REFIT_GPU_TIMEOUT:-300} python3 "$p" 2>&1 | tee -a "$log" "$work/$name.txt" >/dev/null; then
      record "$name" "ok"
    else
      record "$name" "FAILED"
    fi
  done
fi

if [ "$what" = probes ]; then
  # The CUDA C++ probes are built here (nvcc is on the GPU machine); the Python ones need cupy.
  for p in benches/probes/*_probe.cu benches/probes/*_probe.py; do
    [ -e "$p" ] || continue
    name=$(basename "${p%.*}")
    [ -n "$filter" ] && [[ "$name" != *$filter* ]] && continue
    echo "=== probe $name" | tee -a "$log"
    case "$p" in
      *.cu) run=("/tmp/refit-probe-$name" "$REFIT_BENCH_RESULTS/$name.json")
            nvcc -O2 -std=c++17 -arch=native -o "/tmp/refit-probe-$name" "$p" -lcuda -lpthread >>"$log" 2>&1 ||
              { record "$name" "FAILED to build (see gpu.log)"; continue; } ;;
      *) run=(python3 "$p") ;;
    esac
    if timeout ${REFIT_GPU_TIMEOUT:-300} "${run[@]}" 2>&1 | tee -a "$log" "$work/$name.txt" >/dev/null; then
      record "$name" "ok"
    else
      record "$name" "FAILED"
    fi
  done
fi

if [ "$what" = all ] || [ "$what" = demo ]; then
  echo "=== demo ${DEMO_ARGS:-}" | tee -a "$log"
  if timeout 400 .gpu/examples/demo ${DEMO_ARGS:-} 2>&1 | tee -a "$log" "$work/demo.txt"; then
    record demo "ok"
  else
    record demo "FAILED"
  fi
fi

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
for f in "$work"/gpu_*.txt "$work"/*_peer.txt "$work"/*_probe.txt "$work"/demo.txt; do
  [ -e "$f" ] && { echo "--- $(basename "$f")"; grep -E '^\|' "$f" | tail -20; }
done
mkdir -p "${OUT:-/tmp/out}"
cp "$log" "${OUT:-/tmp/out}/" && tar czf "${OUT:-/tmp/out}/gpu.tgz" -C "$work" .
