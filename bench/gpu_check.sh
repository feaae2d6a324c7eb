#!/usr/bin/env bash
# GRPO on a locally built ~0.5B-shape model on CUDA: bf16 + LoRA on one GPU, then bf16 full
# fine-tuning with FSDP on all GPUs; prints tokens/s and peak GPU memory per run. No downloads.
# Under 10 minutes on one H100-class GPU.
#
#     bash bench/gpu_check.sh            # from the repository root, in the project's environment
set -euo pipefail
PY=${PYTHON:-python}
export PYTHONPATH="$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: this check needs a GPU")'
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" bench/gpu_check.py build "$WORK/model"

lora=$("$PY" bench/gpu_check.py run "$WORK/model" "$WORK/lora" \
  --set model.dtype=bfloat16 --set 'model.lora={r: 16, alpha: 32}' | tail -1)
fsdp=$("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
  bench/gpu_check.py run "$WORK/model" "$WORK/fsdp" \
  --set model.dtype=bfloat16 --set dist.strategy=fsdp --set model.gradient_checkpointing=true \
  | tail -1)

"$PY" - "$lora" "$fsdp" "$NGPU" <<'PYEOF'
import json, sys
lora, fsdp, n = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print("| run | GPUs | tokens/s (median) | peak GPU memory, rank 0 (GiB) |")
print("| --- | ---: | ---: | ---: |")
print(f"| bf16 + LoRA r=16, adapter-free reference | 1 | {lora['tokens_per_s']:.0f} | {lora['peak_gib_rank0']:.2f} |")
print(f"| bf16 full fine-tune, FSDP + checkpointing | {n} | {fsdp['tokens_per_s']:.0f} | {fsdp['peak_gib_rank0']:.2f} |")
PYEOF
