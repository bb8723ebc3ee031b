#!/usr/bin/env bash
# Downloads, for a CUDA machine without a registry (Python 3.12), the wheels the test suite needs
# beyond what such a machine already has (numpy, torch): Rewind's own dependencies and the test
# tools, without MLX (../shared/tools/mlx-cuda-wheels.sh carries that), the default model's
# wheels (the real_model tests do not run there) or the vision extra (opencv alone is over the
# 64 MiB a device call carries). Makes .gpu3/ (git-ignored), under 64 MiB. The machine has
# glibc 2.39 (Ubuntu 24.04): manylinux_2_35 wheels run there, and some packages (llguidance 1.9:
# manylinux_2_31) ship no older tag than those listed.
# On the target: python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu3/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
rm -rf .gpu3 && mkdir -p .gpu3
"$py" -m pip download -q -d .gpu3 --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any \
  "mlx-lm>=0.32,<0.33" "gguf>=0.17" "tokenizers>=0.20" "transformers>=5.18" sentencepiece safetensors \
  jinja2 "xxhash>=3" "llguidance>=1.9" psutil "fastapi>=0.110" "uvicorn>=0.29" uvloop httptools "pydantic>=2" \
  prometheus-client rich tqdm "huggingface_hub>=0.24" \
  pytest pytest-timeout pytest-xdist "openai>=1.0" "anthropic>=0.40" httpx jsonschema
# What the machine has or what travels apart: numpy and MLX; hf_xet only speeds downloads.
rm -f .gpu3/numpy-* .gpu3/mlx-* .gpu3/mlx_cpu-* .gpu3/mlx_metal-* .gpu3/hf_xet-* .gpu3/gemma3_270m_*
du -sh .gpu3
