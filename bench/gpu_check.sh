#!/usr/bin/env bash
# GPU check of hemi's CUDA backend, for a machine with a GPU and no Rust toolchain.
#
# Runs the prebuilt CUDA test binary (crates/hemi/tests/cuda/main.rs: casts, unary/binary maps,
# row reductions, softmax, the fused GradScaler unscale, cuBLAS GEMM with F16/BF16 inputs and
# F32 accumulation, allocator reuse, NVRTC compilation of every generated module; each against
# f64 references on the CPU) and writes a JSON summary to $OUT/gpu_check.json plus the full
# log to $OUT/cuda_tests.log. A few minutes at most (the tests themselves take seconds; the
# first NVRTC compile of the three modules is the slowest part).
#
# Build the binary where Rust is (see DEVELOPERS.md):
#   cargo test --release -p hemi --features cuda --test cuda --no-run   # prints the path
#   mkdir -p target/gpu-check && cp <that path> target/gpu-check/hemi-cuda-tests
#   strip target/gpu-check/hemi-cuda-tests
# then, on the GPU machine, from the repository root (carrying target/gpu-check):
#   bash bench/gpu_check.sh [path/to/hemi-cuda-tests]
#
# Exit status: 0 when every test ran on the GPU and passed; 1 when any failed; 2 when any was
# skipped (no device found: on a GPU machine that is a broken setup, not a pass); 3 when the
# binary is missing.
#
# To be added once the CLI can place tensors on CUDA (the core engineer's backend trait), the
# same runs as the CPU numbers in bench/RESULTS.md, on the GPU, with --json into $OUT:
#   hemi bench train --device cuda --model cifar-net --precision amp-fp16 --batch-size 128 --steps 20 --json
#   hemi bench train --device cuda --model cifar-net --precision amp-bf16 --batch-size 128 --steps 20 --json
#   hemi bench train --device cuda --model cifar-net --precision fp32     --batch-size 128 --steps 20 --json
#   hemi bench train --device cuda --model mlp       --precision amp-bf16 --batch-size 512 --steps 50 --json
# compared with the same models in PyTorch on the same GPU (bench/torch_side_by_side.py).

set -u
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
BIN=${1:-target/gpu-check/hemi-cuda-tests}
LOG="$OUT/cuda_tests.log"

if [ ! -x "$BIN" ]; then
    echo "gpu_check: no test binary at $BIN (build it with Rust first, see the header)" >&2
    printf '{"status": "no-binary", "binary": "%s"}\n' "$BIN" >"$OUT/gpu_check.json"
    exit 3
fi

# CUDA libraries: the driver's libcuda.so.1 is on the loader path already; cuBLAS, cuBLASLt
# and NVRTC may come from a toolkit or from NVIDIA's pip wheels (the PyTorch install). Add
# every directory that holds one of them, and the include dirs with cuda_fp16.h for NVRTC.
libdirs=""
incdirs=""
roots="/usr/local/cuda"
if command -v python3 >/dev/null 2>&1; then
    site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
    [ -n "$site" ] && [ -d "$site/nvidia" ] && roots="$roots $site/nvidia"
fi
for root in $roots; do
    [ -d "$root" ] || continue
    for f in $(find -L "$root" -maxdepth 4 \( -name 'libcublas.so*' -o -name 'libcublasLt.so*' -o -name 'libnvrtc.so*' \) 2>/dev/null); do
        d=$(dirname "$f")
        case ":$libdirs:" in *":$d:"*) ;; *) libdirs="$libdirs:$d" ;; esac
    done
    for f in $(find -L "$root" -maxdepth 4 -name cuda_fp16.h 2>/dev/null); do
        d=$(dirname "$f")
        case ":$incdirs:" in *":$d:"*) ;; *) incdirs="$incdirs:$d" ;; esac
    done
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${libdirs}"
export HEMI_CUDA_INCLUDE="${HEMI_CUDA_INCLUDE:-}${incdirs}"
export RUST_BACKTRACE=1

{
    echo "# $(date -u +%FT%TZ) $(uname -srm)"
    echo "# LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "# HEMI_CUDA_INCLUDE=$HEMI_CUDA_INCLUDE"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/# nvidia-smi: /'
} >"$LOG"

start=$(date +%s)
# One thread: the tests share one device and its module cache, and the log stays in order.
# --show-output prints each passing test's stdout, where the SKIPPED lines are.
# `--skip unit::`: the host-side unit tests of `hemi::cuda` (tests/cuda/unit/) share the
# binary; two of them test the no-device path and print a SKIPPED line where a device is
# found, which would read as a broken setup here.
timeout 300 "$BIN" --test-threads=1 --show-output --skip unit:: >>"$LOG" 2>&1
rc=$?
wall=$(( $(date +%s) - start ))

passed=$(grep -E '^test .* \.\.\. ok$' "$LOG" | sed -E 's/^test (.*) \.\.\. ok$/\1/')
failed=$(grep -E '^test .* \.\.\. FAILED$' "$LOG" | sed -E 's/^test (.*) \.\.\. FAILED$/\1/')
skipped=$(grep -oE 'SKIPPED \(no CUDA device\): [A-Za-z0-9_:]+' "$LOG" | sed -E 's/.*: //' | sort -u)
# A skipped test returns early and so reports "ok": it did not pass on the GPU.
passed=$(echo "$passed" | grep -vxF -f <(echo "$skipped") || true)
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)

json_list() { # newline-separated words -> JSON array
    local first=1
    printf '['
    for w in $1; do
        [ $first = 1 ] || printf ', '
        printf '"%s"' "$w"
        first=0
    done
    printf ']'
}
count() { [ -z "$1" ] && echo 0 || echo "$1" | wc -l; }

if [ "$rc" != 0 ] || [ -n "$failed" ]; then status=failed; code=1
elif [ -n "$skipped" ]; then status=skipped; code=2
else status=ok; code=0
fi
{
    printf '{\n'
    printf '  "status": "%s",\n' "$status"
    printf '  "exit_code": %s,\n' "$rc"
    printf '  "wall_s": %s,\n' "$wall"
    printf '  "gpu": "%s",\n' "$gpu"
    printf '  "binary": "%s",\n' "$BIN"
    printf '  "binary_sha256": "%s",\n' "$(sha256sum "$BIN" | cut -d' ' -f1)"
    printf '  "n_passed": %s, "n_failed": %s, "n_skipped": %s,\n' "$(count "$passed")" "$(count "$failed")" "$(count "$skipped")"
    printf '  "passed": %s,\n' "$(json_list "$passed")"
    printf '  "failed": %s,\n' "$(json_list "$failed")"
    printf '  "skipped": %s\n' "$(json_list "$skipped")"
    printf '}\n'
} >"$OUT/gpu_check.json"

cat "$OUT/gpu_check.json"
[ -n "$failed" ] && grep -A30 -E '^---- .* stdout ----$' "$LOG" | grep -vE '^\s*$' | head -80
exit $code
