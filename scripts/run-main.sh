#!/usr/bin/env bash
# The main job: starts tsd on its default local socket (unless one is already running there),
# runs the Python fine-tune through it, then stops the tsd it started. Run scripts/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
sock=${TSD_SOCKET:-$(build/bin/tsd --print-config | sed -n "s/^socket = '\(.*\)'$/\1/p")}
started=""
if ! build/bin/tsctl --socket "$sock" status >/dev/null 2>&1; then
  build/bin/tsd --socket "$sock" --pool-size 1GiB &
  started=$!
  trap 'kill -TERM $started 2>/dev/null; wait $started 2>/dev/null || true' EXIT
  for _ in $(seq 100); do build/bin/tsctl --socket "$sock" status >/dev/null 2>&1 && break; sleep 0.1; done
fi
build/bin/tsctl --socket "$sock" status
# The Python fine-tune (examples/finetune_tiny.py): a small GPT trained through tsd next to stock
# AdamW, with the losses side by side and where the memory lives. scripts/setup.sh installed the
# trainstream package into .venv/.
.venv/bin/python examples/finetune_tiny.py --socket "$sock"
