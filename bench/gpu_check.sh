#!/usr/bin/env bash
# GPU check of hemi for a machine with an NVIDIA GPU and no Rust toolchain: one command, at
# most 8 minutes (a deadline skips what would run past it, and says so). From the
# repository root, with the binaries built here and carried in target/gpu-check:
#
#   bash bench/gpu_check.sh --build     # where Rust is: builds and copies what to carry
#   bash bench/gpu_check.sh             # on the GPU machine; writes into $OUT
#
# What it runs, each part's log and JSON in $OUT, the summary in $OUT/gpu_check.json:
# 1. The wgpu backend's test suite (crates/hemi/tests/gpu: every primitive against the CPU,
#    training steps of CifarNet, ResNet-20 and BERT under fp32/amp-fp16/amp-bf16, the
#    loader's uploads, checkpoints across devices, and the ignored 200-step CifarNet
#    amp-fp16 run) on the real GPU through Vulkan, HEMI_REQUIRE_GPU=1 and HEMI_REQUIRE_SHADER_F16=1 (`wgpu_tests.log`).
# 2. `hemi bench train --device gpu` for CifarNet (batch 128, 32x32), ResNet-50 (batch 32,
#    224x224) and BERT (all-MiniLM-L6-v2's shape from bench/minilm_config.json, fresh
#    weights, batch 32 x 64 tokens) under fp32, amp-fp16 and amp-bf16 (`hemi_bench.jsonl`).
# 3. The same steps in PyTorch on CUDA (bench/torch_cuda_train.py: fp32, autocast fp16 with
#    a GradScaler, autocast bf16) with the machine's python3 (`torch_bench.jsonl`); without
#    PyTorch, CUDA, torchvision or transformers each run records why.
# 4. The CUDA backend's test binary (crates/hemi/tests/cuda), when it was carried
#    (`cuda_tests.log`): see DEVELOPERS.md.
#
# Vulkan: the system's loader, else the libvulkan.so.1 carried in target/gpu-check/lib;
# NVIDIA's ICD file where the driver installed one, else one written into $OUT for the
# driver's libGLX_nvidia.so.0. Only NVIDIA's driver is offered to the loader when it is
# found, so that gpu:0 is the GPU and not a software device; the adapter each run used is
# in its JSON (a software adapter on an NVIDIA machine makes the status "software-adapter").
#
# Knobs: STEPS (timed steps per bench run, default 10), GPU_CHECK_SMALL=1 (tiny shapes:
# batch 2, 32x32 ResNet-50, 16 tokens; to try the script on lavapipe), GPU_CHECK_TESTS (a
# test-name filter), GPU_CHECK_BUDGET_S (default 450), PYTHON (default python3).
#
# Exit status: 0 when every part ran on the GPU and passed; 1 when a test or a hemi bench
# run failed; 2 when a test was skipped, no usable Vulkan GPU was found, or the deadline
# skipped a hemi run (status "incomplete"); 3 when the binaries are missing. A missing PyTorch is reported in the JSON, not in the status.

set -u
cd "$(dirname "$0")/.."
BIN_DIR=${GPU_CHECK_BIN:-target/gpu-check}

if [ "${1:-}" = "--build" ]; then
    # Where Rust is. The copies are stripped; the Vulkan loader goes with them for a machine
    # without one.
    set -e
    mkdir -p "$BIN_DIR/lib"
    tests=$(cargo test --release -p hemi --features gpu --test gpu --no-run --message-format=json \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    cargo build --release -p hemi-cli --features gpu
    cp "$tests" "$BIN_DIR/hemi-gpu-tests"
    cp "${CARGO_TARGET_DIR:-target}/release/hemi" "$BIN_DIR/hemi"
    strip "$BIN_DIR/hemi-gpu-tests" "$BIN_DIR/hemi"
    loader=$(ldconfig -p | awk '/libvulkan\.so\.1 /{print $NF; exit}')
    [ -n "$loader" ] && cp -L "$loader" "$BIN_DIR/lib/libvulkan.so.1"
    echo "built: $(ls "$BIN_DIR" "$BIN_DIR/lib" | tr '\n' ' ')"
    echo "carry $BIN_DIR; the CUDA test binary (optional) is $BIN_DIR/hemi-cuda-tests (DEVELOPERS.md)"
    exit 0
fi

OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
STEPS=${STEPS:-10}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
PY=${PYTHON:-python3}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
log() { echo "gpu_check: $*" >&2; }

HEMI="$BIN_DIR/hemi"
TESTS="$BIN_DIR/hemi-gpu-tests"
CUDA_TESTS="$BIN_DIR/hemi-cuda-tests"
for b in "$HEMI" "$TESTS"; do
    if [ ! -x "$b" ]; then
        log "no binary at $b (build with 'bash bench/gpu_check.sh --build' where Rust is)"
        printf '{"status": "no-binary", "binary": "%s"}\n' "$b" >"$OUT/gpu_check.json"
        exit 3
    fi
done

# ----- Vulkan ------------------------------------------------------------------------------
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1 ' && [ -e "$BIN_DIR/lib/libvulkan.so.1" ]; then
    export LD_LIBRARY_PATH="$PWD/$BIN_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "using the carried Vulkan loader"
fi
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
icd=""
if [ -n "$gpu" ]; then
    for f in /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json; do
        [ -f "$f" ] && icd=$f && break
    done
    if [ -z "$icd" ]; then
        lib=$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia\.so\.0 /{print $NF; exit}')
        [ -z "$lib" ] && lib=$(ls /usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.0 /usr/lib64/libGLX_nvidia.so.0 2>/dev/null | head -1)
        if [ -n "$lib" ]; then
            icd="$OUT/nvidia_icd.json"
            printf '{"file_format_version": "1.0.1", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$lib" >"$icd"
        fi
    fi
    if [ -n "$icd" ]; then
        export VK_DRIVER_FILES="$icd" VK_ICD_FILENAMES="$icd"
        log "NVIDIA's Vulkan driver: $icd"
    else
        log "an NVIDIA GPU ($gpu) but no Vulkan driver for it: libGLX_nvidia.so.0 is missing (a container needs NVIDIA_DRIVER_CAPABILITIES to include graphics)"
    fi
fi
export RUST_BACKTRACE=1

# ----- 1. the wgpu test suite --------------------------------------------------------------
TLOG="$OUT/wgpu_tests.log"
{
    echo "# $(date -u +%FT%TZ) $(uname -srm) gpu: ${gpu:-none} icd: ${icd:-system}"
} >"$TLOG"
t0=$(date +%s)
tlimit=$(( $(left) / 2 ))
[ "$tlimit" -gt 300 ] && tlimit=300
# One thread: the log stays in order, and the tests share one device. --include-ignored
# runs the 200-step CifarNet amp-fp16 comparison, seconds on a real GPU.
filter=()
[ -n "${GPU_CHECK_TESTS:-}" ] && filter=("$GPU_CHECK_TESTS")
# The drivers' own messages (stderr) go apart, so that they cannot split a result line.
HEMI_REQUIRE_GPU=1 HEMI_REQUIRE_SHADER_F16=1 timeout "$tlimit" "$TESTS" --test-threads=1 --include-ignored --show-output "${filter[@]}" >>"$TLOG" 2>"$OUT/wgpu_tests.stderr"
trc=$?
twall=$(( $(date +%s) - t0 ))
passed=$(grep -E '^test .* \.\.\. ok$' "$TLOG" | sed -E 's/^test (.*) \.\.\. ok$/\1/')
failed=$(grep -E '^test .* \.\.\. FAILED$' "$TLOG" | sed -E 's/^test (.*) \.\.\. FAILED$/\1/')
skipped=$(grep -oE '^[A-Za-z0-9_:]+: SKIPPED \(no GPU adapter\)' "$TLOG" | sed -E 's/: SKIPPED.*//' | sort -u)
count() { [ -z "$1" ] && echo 0 || echo "$1" | wc -l; }
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
log "tests: $(count "$passed") passed, $(count "$failed") failed, exit $trc, ${twall} s"

# ----- 2. and 3. hemi and PyTorch, side by side ----------------------------------------------
if [ "${GPU_CHECK_SMALL:-0}" = 1 ]; then
    small=1
else
    small=0
fi
HB="$OUT/hemi_bench.jsonl"
TB="$OUT/torch_bench.jsonl"
: >"$HB"
: >"$TB"
bench_failed=0
incomplete=0
software=0
have_py=1
command -v "$PY" >/dev/null 2>&1 || have_py=0
for model in cifar-net resnet50 bert; do
    case "$model:$small" in
        cifar-net:0) hargs=(--model cifar-net --batch-size 128); targs=(--model cifar-net --batch 128) ;;
        cifar-net:1) hargs=(--model cifar-net --batch-size 2); targs=(--model cifar-net --batch 2) ;;
        resnet50:0) hargs=(--model resnet50 --batch-size 32 --image-size 224); targs=(--model resnet50 --batch 32 --image-size 224) ;;
        resnet50:1) hargs=(--model resnet50 --batch-size 2 --image-size 32); targs=(--model resnet50 --batch 2 --image-size 32) ;;
        bert:0) hargs=(--model bert-classifier --config bench/minilm_config.json --batch-size 32 --max-length 64)
                targs=(--model bert --config bench/minilm_config.json --batch 32 --length 64) ;;
        bert:1) hargs=(--model bert-classifier --config bench/minilm_config.json --batch-size 2 --max-length 16)
                targs=(--model bert --config bench/minilm_config.json --batch 2 --length 16) ;;
    esac
    for pair in fp32:fp32 amp-fp16:fp16 amp-bf16:bf16; do
        hp=${pair%%:*}
        tp=${pair##*:}
        budget=$(left)
        if [ "$budget" -lt 20 ]; then
            log "skipping hemi $model $hp: past the time budget"
            printf '{"status": "skipped", "why": "time budget", "model": "%s", "precision": "%s"}\n' "$model" "$hp" >>"$HB"
            printf '{"status": "skipped", "why": "time budget", "model": "%s", "mode": "%s"}\n' "$model" "$tp" >>"$TB"
            incomplete=1
            continue
        fi
        lim=$((budget < 90 ? budget : 90))
        timeout "$lim" "$HEMI" bench train --device gpu --threads 4 --json --steps "$STEPS" --precision "$hp" "${hargs[@]}" >"$OUT/hemi_bench.out" 2>"$OUT/hemi_bench.err"
        rc=$?
        line=$(tail -1 "$OUT/hemi_bench.out")
        if [ $rc = 0 ] && [ -n "$line" ]; then
            echo "$line" >>"$HB"
            case "$line" in *llvmpipe*|*lavapipe*|*SwiftShader*) software=1 ;; esac
            log "hemi $model $hp: $line"
        else
            bench_failed=1
            why=$(grep -v XDG_RUNTIME_DIR "$OUT/hemi_bench.err" | tail -3 | tr '\n"' ' \047')
            [ $rc = 124 ] && why="timed out after ${lim} s; $why"
            printf '{"status": "failed", "exit_code": %s, "model": "%s", "precision": "%s", "why": "%s"}\n' "$rc" "$model" "$hp" "$why" >>"$HB"
            log "hemi $model $hp failed ($rc): $why"
        fi
        budget=$(left)
        if [ "$have_py" = 0 ]; then
            printf '{"status": "unavailable", "why": "no %s on this machine", "model": "%s", "mode": "%s"}\n' "$PY" "$model" "$tp" >>"$TB"
        elif [ "$budget" -lt 15 ]; then
            printf '{"status": "skipped", "why": "time budget", "model": "%s", "mode": "%s"}\n' "$model" "$tp" >>"$TB"
        else
            lim=$((budget < 90 ? budget : 90))
            line=$(timeout "$lim" "$PY" bench/torch_cuda_train.py --mode "$tp" --steps "$STEPS" "${targs[@]}" 2>>"$OUT/torch_bench.err" | tail -1)
            [ -n "$line" ] || line=$(printf '{"status": "failed", "model": "%s", "mode": "%s", "why": "no output; see torch_bench.err"}' "$model" "$tp")
            echo "$line" >>"$TB"
            log "pytorch $model $tp: $line"
        fi
    done
done

# ----- 4. the CUDA backend's tests, when carried -------------------------------------------
cuda_status="not-carried"
if [ -x "$CUDA_TESTS" ] && [ "$(left)" -gt 30 ]; then
    # cuBLAS, cuBLASLt and NVRTC from a toolkit or NVIDIA's pip wheels (the PyTorch install).
    libdirs=""
    incdirs=""
    roots="/usr/local/cuda"
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
    [ -n "$site" ] && [ -d "$site/nvidia" ] && roots="$roots $site/nvidia"
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
    CLOG="$OUT/cuda_tests.log"
    # --skip unit::: the host-side tests of the binary, two of which test the no-device path.
    LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${libdirs}" HEMI_CUDA_INCLUDE="${HEMI_CUDA_INCLUDE:-}${incdirs}" \
        timeout $(( $(left) - 10 )) "$CUDA_TESTS" --test-threads=1 --show-output --skip unit:: >"$CLOG" 2>&1
    crc=$?
    cfailed=$(grep -cE '^test .* \.\.\. FAILED$' "$CLOG")
    cskipped=$(grep -cE 'SKIPPED \(no CUDA device\)' "$CLOG")
    if [ "$crc" != 0 ] || [ "$cfailed" != 0 ]; then cuda_status=failed
    elif [ "$cskipped" != 0 ]; then cuda_status=skipped
    else cuda_status=ok
    fi
fi

# ----- summary -----------------------------------------------------------------------------
if [ -n "$gpu" ] && [ -z "$icd" ]; then status=no-vulkan-driver; code=2
elif [ "$trc" != 0 ] || [ -n "$failed" ] || [ "$bench_failed" = 1 ] || [ "$cuda_status" = failed ]; then status=failed; code=1
elif [ -n "$skipped" ] || [ -z "$passed" ]; then status=skipped; code=2
elif [ "$incomplete" = 1 ]; then status=incomplete; code=2
elif [ -n "$gpu" ] && [ "$software" = 1 ]; then status=software-adapter; code=2
else status=ok; code=0
fi
join() { awk 'NR > 1 { printf ",\n    " } { printf "%s", $0 }' "$1"; } # lines -> array items
{
    printf '{\n'
    printf '  "status": "%s",\n' "$status"
    printf '  "wall_s": %s, "budget_s": %s,\n' "$(( $(date +%s) - start ))" "$BUDGET"
    printf '  "gpu": "%s", "vulkan_icd": "%s", "small": %s, "steps": %s,\n' "$gpu" "$icd" "$small" "$STEPS"
    printf '  "tests": {"exit_code": %s, "wall_s": %s, "n_passed": %s, "n_failed": %s, "n_skipped": %s,\n' \
        "$trc" "$twall" "$(count "$passed")" "$(count "$failed")" "$(count "$skipped")"
    printf '    "failed": %s, "skipped": %s},\n' "$(json_list "$failed")" "$(json_list "$skipped")"
    printf '  "hemi_bench": [\n    %s\n  ],\n' "$(join "$HB")"
    printf '  "torch_bench": [\n    %s\n  ],\n' "$(join "$TB")"
    printf '  "cuda_tests": "%s"\n' "$cuda_status"
    printf '}\n'
} >"$OUT/gpu_check.json"
cat "$OUT/gpu_check.json"
[ -n "$failed" ] && grep -A30 -E '^---- .* stdout ----$' "$TLOG" | grep -vE '^\s*$' | head -80
exit $code
