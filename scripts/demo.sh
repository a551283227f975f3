#!/usr/bin/env bash
# The demo: install, show a plan, then train a small Qwen3 on 2 ranks with ds_canzona's ZeRO-2
# Muon (CPU ranks on gloo where there is no GPU), then a small MoE LM with expert parallelism. The
# plan summary is logged at init and the progress bar shows the loss falling.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo
echo "== The plan for Qwen3-32B at DP=32 (ds-canzona plan --model qwen3-32b --dp 32) =="
ds-canzona plan --model qwen3-32b --dp 32

echo
echo "== Training a tiny Qwen3 on 2 ranks: deepspeed --num_gpus 2 examples/train_qwen3.py =="
deepspeed --num_gpus 2 examples/train_qwen3.py --deepspeed_config ds_configs/zero2_muon.hjson \
  --steps "${DEMO_STEPS:-30}" --save-dir "${DEMO_SAVE_DIR:-out/demo}" --save-every 10

echo
echo "== A small mixture-of-experts LM (DeepSpeed MoE layers, EP=2) on 2 ranks: examples/train_moe.py =="
deepspeed --num_gpus 2 examples/train_moe.py --ep 2 --steps "${DEMO_MOE_STEPS:-20}"
