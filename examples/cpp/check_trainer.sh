#!/usr/bin/env bash
# Runs torch_trainer against a daemon of its own: starts TSD on a socket in a fresh directory,
# runs TRAINER with the remaining arguments, stops the daemon, and exits with the trainer's code.
#   check_trainer.sh TSD TRAINER [ARGS...]
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: check_trainer.sh TSD TRAINER [ARGS...]" >&2
  exit 2
fi
tsd=$1 trainer=$2
shift 2
dir=$(mktemp -d /tmp/tsd-trainer-XXXXXX)
"$tsd" --socket "$dir/tsd.sock" --pool-size 256MiB --metrics-listen "" 2>"$dir/tsd.log" &
pid=$!
cleanup() {
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
for _ in $(seq 100); do
  [ -S "$dir/tsd.sock" ] && break
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "check_trainer.sh: tsd exited; its log:" >&2
    cat "$dir/tsd.log" >&2
    exit 1
  fi
  sleep 0.1
done
rc=0
"$trainer" --socket "$dir/tsd.sock" "$@" || rc=$?
[ "$rc" = 0 ] || { echo "check_trainer.sh: tsd's log:" >&2; cat "$dir/tsd.log" >&2; }
exit "$rc"
