#!/usr/bin/env bash
# the default's 6 GiB Q4_K 448 px prompt after a decode, its first offloaded layer streamed before the vision tower
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name --format=csv,noheader
PROMPTS_TIMEOUT=110 PROMPTS_CONFIGS="vismmoe:expert_budget=6GiB,store_dtype=q4_k" \
  bash scripts/device_session.sh prompts 448 2>&1 | grep -vE "it/s\]|^Writing" | tail -30
