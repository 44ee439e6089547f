#!/usr/bin/env bash
# Next session, call A (cold; set TSD_BENCH_COMMIT to HEAD first): the 1.5B sweep at clip 1e3 with
# STREAM measured before and after the modes (the bound takes the higher), the refinement and the
# copies back ahead; then, if time is left, the 7B at 16 GiB with the copies ahead.
export TSD_BENCH_COMMIT=db7668a
T0=$SECONDS; L=${L:-590}
[ -x /tmp/bg/bin/tsd ] && [ -d /tmp/tspy/trainstream ] || scripts/gpu.sh build min 2>&1 | tail -1
timeout 120 scripts/gpu.sh pytest tests/python/test_wrap_cuda.py -k "checkpointed or activation_offload_is_bit" -q -s 2>&1 | grep -E "activation_offload=|passed|failed|Error" | tail -6
timeout $((L - (SECONDS - T0))) scripts/gpu.sh finetune --arch qwen1.5b --batch 8 --seq 512 --steps 12 --repeats 1 --overlap on --clip 1000 \
  --param-offload auto --activation-offload auto \
  --modes stock,tsd_bf16_act:cap=12:gpu=auto,tsd_bf16_act:cap=12:gpu=auto:ckpt,tsd_bf16_act:cap=16:gpu=auto,tsd_bf16_act:cap=16:gpu=auto:ckpt,tsd_bf16_act:cap=24:gpu=auto,tsd_bf16_act:cap=32:gpu=auto > $OUT/sweep.log 2>&1
grep -v "^@@" $OUT/sweep.log | grep "Error\|bound\|under way\|run 20\|^|\|Traceback" | cut -c1-400 | tail -24
echo "== t=$((SECONDS - T0))"
mv $OUT/finetune.jsonl $OUT/finetune_15b.jsonl 2>/dev/null
R=$((L - (SECONDS - T0)))
[ $R -gt 200 ] && timeout $R scripts/gpu.sh finetune --arch qwen7b --batch 4 --seq 512 --steps 12 --repeats 1 --overlap on --pool-size 112GiB --clip 1000 \
  --param-offload auto --activation-offload auto --modes tsd_bf16m_act:cap=16:gpu=auto:alloc=expandable > $OUT/sweep7b.log 2>&1
grep -v "^@@" $OUT/sweep7b.log 2>/dev/null | grep "Error\|bound\|under way\|run 20\|^|" | cut -c1-400 | tail -8
echo "== t=$((SECONDS - T0))"
