#!/usr/bin/env bash
# One-GPU check of the training path, under 5 minutes: peak bf16 matmul, then ~1B dense (llama_1b)
# and an 8-expert top-2 MoE (moe_8x_top2), bf16, 20 timed steps each, with tokens/s and MFU against
# the datasheet bf16 peak. With no venv yet it makes one (on a GPU machine pip's torch 2.13.0 is CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip setuptools wheel
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q "torch==2.13.0" -e .
fi
export RAY_USAGE_STATS_ENABLED=0 MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/conduit/torch_extensions}
"$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.get_device_name(0))"
# 1B dense at micro batch 4 x 2048 tokens; the MoE with the same batch. Extra flags pass through.
timeout 280 "$VENV/bin/python" benchmarks/gpu_check.py --device cuda --steps 20 "$@"
