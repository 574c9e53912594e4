#!/usr/bin/env bash
# Runs the fuzz targets built in BUILD_DIR (see fuzz/CMakeLists.txt): first every committed seed and
# regression input once (each must pass), then libFuzzer for SECONDS (or RUNS executions, whichever
# ends first) per target, one target at a time. Writes BUILD_DIR/fuzz-summary.tsv (target, execs,
# seconds, exec/s, corpus size, result); exits non-zero when any target found a crash, a leak, UB,
# a timeout or an escaped exception (the input is kept under BUILD_DIR/artifacts/).
#
# usage: fuzz/run.sh BUILD_DIR SECONDS [RUNS] TARGET...
set -uo pipefail
BUILD_DIR=$1
SECONDS_PER_TARGET=$2
RUNS=$3
shift 3
HERE=$(cd "$(dirname "$0")" && pwd)
declare -A MAX_LEN=([tokenizer_load]=16384 [chat_template]=8192 [server_config]=8192 [request_body]=8192)
# structured_output: each compile runs on a detached thread (GrammarCompiler's timeout) that frees
# its state just after the input returns, so mallocs never balance frees per input and libFuzzer's
# per-input leak check would scan the whole heap after most inputs (60 % of the run's time).
declare -A EXTRA=([structured_output]="-detect_leaks=0")
summary="$BUILD_DIR/fuzz-summary.tsv"
printf "target\texecs\tseconds\texec_per_s\tcorpus\tresult\n" > "$summary"
failed=0
for t in "$@"; do
  bin="$BUILD_DIR/fuzz_$t"
  work="$BUILD_DIR/corpus/$t"
  mkdir -p "$work" "$BUILD_DIR/artifacts"
  log="$BUILD_DIR/fuzz_$t.log"
  seeds=("$HERE/corpus/$t")
  [ -d "$HERE/regressions/$t" ] && seeds+=("$HERE/regressions/$t")
  common=(-dict="$HERE/dict/$t.dict" -max_len="${MAX_LEN[$t]:-4096}" -timeout=10 -rss_limit_mb=2048
          -artifact_prefix="$BUILD_DIR/artifacts/$t-" -print_final_stats=1 ${EXTRA[$t]:-})
  # Replay: every committed input once, as a regression test.
  if ! "$bin" "${common[@]}" -runs=0 "${seeds[@]}" > "$log.replay" 2>&1; then
    echo "fuzz $t: a committed seed or regression input fails:"; tail -30 "$log.replay"
    printf "%s\t0\t0\t0\t0\treplay-failed\n" "$t" >> "$summary"
    failed=1
    continue
  fi
  start=$(date +%s.%N)
  "$bin" "${common[@]}" -max_total_time="$SECONDS_PER_TARGET" ${RUNS:+-runs=$RUNS} "$work" "${seeds[@]}" > "$log" 2>&1
  rc=$?
  took=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { print e - s }')
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  corpus=$(ls "$work" | wc -l)
  if [ $rc -eq 0 ]; then result=ok; else result="FAILED(rc=$rc)"; failed=1; fi
  printf "%s\t%s\t%.0f\t%s\t%s\t%s\n" "$t" "${execs:-?}" "$took" "${rate:-?}" "$corpus" "$result" >> "$summary"
  printf "fuzz %-20s %10s execs %6.0f s %8s exec/s  corpus %5s  %s\n" "$t" "${execs:-?}" "$took" "${rate:-?}" "$corpus" "$result"
  if [ $rc -ne 0 ]; then grep -B5 -A40 "ERROR\|==ERROR\|fuzz:\|runtime error\|deadly signal" "$log" | head -80; fi
done
exit $failed
