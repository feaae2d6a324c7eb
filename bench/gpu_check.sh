#!/usr/bin/env bash
# The GPU check, one command (bench/gpu_check.py says what it runs): klpo's CUDA tests, GRPO on a
# 0.5B-shape model with the real vocabulary (bf16 + LoRA, FSDP on all GPUs, the forward-pass
# gradient on and off, the sampler one version behind with and without the rollout worker's
# overlap) side by side with TRL's GRPOTrainer on the same job and GPU, and the log-prob kernels
# against naive PyTorch and Liger-Kernel's Triton kernels; one table of ratios.
# Within 9⅓ minutes on one GPU; nothing is downloaded. The peers (TRL, Liger-Kernel, and what they
# and klpo need beyond the machine's own packages) are installed from bench/wheels/, prepared
# beforehand by bench/gpu_wheels.sh, into a temporary folder: no network needed.
#
#     bash bench/gpu_check.sh [--dry-run] [--logs DIR] [--json FILE]
#
# --dry-run: the same stages on the CPU at tiny shapes (the test suite runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
if compgen -G "bench/wheels/*.whl" > /dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$SITE" bench/wheels/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$(pwd)/src:$(pwd)/bench${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF' >&2
import importlib, importlib.metadata as md, sys
found = []
for name, dist in (("torch", "torch"), ("transformers", "transformers"), ("peft", "peft"),
                   ("datasets", "datasets"), ("trl", "trl"), ("liger_kernel", "liger-kernel"),
                   ("pydantic", "pydantic"), ("klpo", None)):
    try:
        importlib.import_module(name)  # reported, not fatal: the stages that need it say so
        found.append(f"{name} {md.version(dist) if dist else 'from src/'}")
    except Exception as err:
        found.append(f"{name} absent ({type(err).__name__}: {err})")
print(f"python {sys.version.split()[0]}; " + "; ".join(found))
PYEOF
"$PY" bench/gpu_check.py "$@"
