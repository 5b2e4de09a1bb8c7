#!/bin/sh
# Runs each fuzz target in turn for $SECS seconds (default 1200) at the lowest CPU
# priority, one at a time, in fork mode so that a crash, timeout or OOM is saved under
# artifacts/TARGET/ and fuzzing goes on. Runs the binaries `cargo +nightly fuzz build -O`
# left (so editing hemi meanwhile does not start a rebuild). Logs: logs/TARGET.log.
# From fuzz/:  cargo +nightly fuzz build -O && nohup sh run_all.sh [TARGET...] &
SECS=${SECS:-1200}
TARGETS=${*:-"image idx_gz safetensors idx_raw cifar10 checkpoint_manifest checkpoint_state"}
BIN=target/x86_64-unknown-linux-gnu/release
mkdir -p logs
for t in $TARGETS; do
    case $t in
        cifar10) len=10000 ;;
        checkpoint_state) len=8192 ;;
        *) len=4096 ;;
    esac
    mkdir -p corpus/$t artifacts/$t
    cp $BIN/$t logs/$t.bin
    echo "== $t start $(date -u +%FT%TZ)" >> logs/run_all.log
    nice -n 19 logs/$t.bin corpus/$t seeds/$t \
        -max_total_time=$SECS -rss_limit_mb=2048 -max_len=$len -timeout=10 \
        -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
        -artifact_prefix=artifacts/$t/ > logs/$t.log 2>&1
    echo "== $t end $(date -u +%FT%TZ) rc=$?" >> logs/run_all.log
done
