#!/usr/bin/env bash
# Call A: build; the CUDA tests of checkpointing and recompute beside the pagers; the 1.5B sweep at
# clip 1e3 (STREAM before and after the modes), paging against recompute (activation_recompute=auto)
# and the model's own checkpointing (:ckpt) at 12 and 16 GiB, then 24 and 32.
export TSD_BENCH_COMMIT=bc96aae
T0=$SECONDS; L=${L:-590}
[ -x /tmp/bg/bin/tsd ] && [ -d /tmp/tspy/trainstream ] || scripts/gpu.sh build min 2>&1 | tail -1
echo "== built t=$((SECONDS - T0))"
timeout 150 scripts/gpu.sh pytest tests/python/test_wrap_cuda.py -k "checkpointed or recompute or activation_offload_is_bit" 2>&1 | tail -4
cp $OUT/pytest.txt $OUT/pytest_cuda.txt 2>/dev/null
echo "== tests t=$((SECONDS - T0))"
timeout $((L - (SECONDS - T0))) scripts/gpu.sh finetune --arch qwen1.5b --batch 8 --seq 512 --steps 12 --repeats 1 --overlap on --clip 1000 \
  --param-offload auto --activation-offload auto \
  --modes stock,tsd_bf16_act:cap=12:gpu=auto,tsd_bf16_act:cap=12:gpu=auto:recompute=auto,tsd_bf16_act:cap=16:gpu=auto,tsd_bf16_act:cap=16:gpu=auto:recompute=auto,tsd_bf16_act:cap=12:gpu=auto:ckpt,tsd_bf16_act:cap=24:gpu=auto,tsd_bf16_act:cap=24:gpu=auto:recompute=auto,tsd_bf16_act:cap=16:gpu=auto:ckpt,tsd_bf16_act:cap=32:gpu=auto > $OUT/sweep.log 2>&1
grep -v "^@@" $OUT/sweep.log | grep "Error\|bound\|under way\|run 20\|^|\|Traceback" | cut -c1-400 | tail -30
echo "== t=$((SECONDS - T0))"
