#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on a GPU machine without network: the peers (TRL,
# Liger-Kernel) and what they and klpo need beyond a CUDA machine's usual Python packages (torch,
# triton, transformers, accelerate, peft, tokenizers, safetensors, numpy, pandas, pyarrow,
# PyYAML, typer, rich, matplotlib, tensorboard), downloaded here into bench/wheels/ (ignored by
# git; under 60 MiB). Carry that folder with the checkout; gpu_check.sh installs them with
# --no-index --no-deps into a temporary folder.
#
#     bash bench/gpu_wheels.sh              # for the GPU machine's Python (3.12 by default)
#     GPU_PYTHON=3.11 bash bench/gpu_wheels.sh
#
# The versions are the ones the CPU benchmarks run with (TRL 1.16.0, Liger-Kernel 0.8.5) and
# their dependencies' as resolved there; one version of each, so that --no-deps installs agree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=bench/wheels
GPU_PYTHON=${GPU_PYTHON:-3.12}
PINS=(
  trl==1.16.0
  liger-kernel==0.8.5
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$GPU_PYTHON" --implementation cp --abi "cp${GPU_PYTHON/./}" --abi abi3 \
  --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DEST" "${PINS[@]}"
echo "*" > "$DEST/.gitignore"  # never committed, whatever the top-level .gitignore says
size=$(du -sk "$DEST" | cut -f1)
ls -1 "$DEST"
echo "$DEST: $((size / 1024)) MiB in $(ls "$DEST"/*.whl | wc -l) wheels"
if [ "$size" -ge $((60 * 1024)) ]; then
  echo "over 60 MiB: too large to carry with the checkout" >&2
  exit 1
fi
