#!/usr/bin/env bash
# The GPU demo as one measured run: the SFT warm start, then GRPO (configs/grpo/gpu_demo.yaml),
# with the GPUs' utilization and memory sampled every 2 s. Copies what bench/RESULTS.md
# reports into OUT_DIR: both runs' metrics, the printed log, the GPU samples.
#
#   bash bench/gpu_demo.sh OUT_DIR [overrides...]       e.g. provisioner.colocate=false
#
# Runs from the repository root; PYTHON (default python) must import forge's dependencies.
set -uo pipefail
out=${1:?usage: bench/gpu_demo.sh OUT_DIR [overrides...]}
shift
mkdir -p "$out"
PYTHON=${PYTHON:-python}
LIMIT_S=${LIMIT_S:-540}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1

sampler=""
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total --format=csv -l 2 \
        >"$out/gpu_samples.csv" &
    sampler=$!
fi
started=$(date +%s)
timeout "$LIMIT_S" "$PYTHON" -m apps.grpo.main --config configs/grpo/gpu_demo.yaml "$@" 2>&1 | tee "$out/log.txt"
status=${PIPESTATUS[0]}
echo "exit status $status after $(( $(date +%s) - started )) s (limit ${LIMIT_S} s)" | tee -a "$out/log.txt"
[ -n "$sampler" ] && kill "$sampler"
cp runs/sft_gpu_demo/metrics.jsonl "$out/sft_metrics.jsonl" 2>/dev/null
cp runs/grpo_gpu_demo/metrics.jsonl "$out/grpo_metrics.jsonl" 2>/dev/null
exit "$status"
