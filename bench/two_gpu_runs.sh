#!/usr/bin/env bash
# The runs that need two GPUs (issue 22), one per device call on a 2-GPU machine where the core
# and vLLM wheel sets are installed (bench/RESULTS.md), back to back. Logs land in OUT_DIR.
#
#   bash bench/two_gpu_runs.sh demo|throughput|fsdp|vllm_tp|qwen17 OUT_DIR
#
#   demo        configs/grpo/gpu_demo.yaml, trainer on GPU 0 and generator on GPU 1
#   throughput  the trl preset at 0.6B, disaggregated (provisioner.colocate=false) and with the
#               trainer over both GPUs and everything colocated, max_policy_age 0 and 1
#   fsdp        trainer.procs=2, generator colocated, KL on; losses against one GPU's on the
#               same batches (bench/fsdp_parity.py)
#   vllm_tp     vLLM with tensor_parallel_size=2: generation, updates, parity (bench/vllm_tp_check.py)
#   qwen17      configs/grpo/qwen3_1_7b.yaml as shipped, a random 1.7B policy, 10 steps
set -uo pipefail
run=${1:?usage: bench/two_gpu_runs.sh demo|throughput|fsdp|vllm_tp|qwen17 OUT_DIR}
out=${2:?usage: bench/two_gpu_runs.sh RUN OUT_DIR}
mkdir -p "$out"
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null
case $run in
    demo) bash bench/gpu_demo.sh "$out/demo" provisioner.colocate=false ;;
    throughput)
        for placement in provisioner.colocate=false "provisioner.colocate=true trainer.procs=2"; do
            # shellcheck disable=SC2086 # the placement's words are separate overrides
            "$PYTHON" bench/gpu_throughput.py --out /tmp/tp2 --engine vllm --preset trl --sizes 0.6B \
                --steps 7 --variants age0-drain,age1-drain $placement || exit
        done
        cp /tmp/tp2/results.json "$out/" ;;
    fsdp) "$PYTHON" bench/fsdp_parity.py --out "$out/fsdp" --procs 2 && cp "$out/fsdp/losses.json" "$out/" ;;
    vllm_tp) "$PYTHON" bench/vllm_tp_check.py --out /tmp/vllm_tp --size 0.6B --tp 2 ;;
    qwen17)
        "$PYTHON" bench/gpu_throughput.py --export 1.7B /tmp/q17 || exit
        "$PYTHON" -c "
from forge.data.toy_task import ToyTaskConfig, make_splits, write_jsonl
train, evaluation = make_splits(ToyTaskConfig())
write_jsonl(train, '/tmp/q17/prompts.jsonl'), write_jsonl(evaluation, '/tmp/q17/eval.jsonl')
" || exit
        "$PYTHON" -m apps.grpo.main --config configs/grpo/qwen3_1_7b.yaml policy_path=/tmp/q17/policy \
            dataset.path=/tmp/q17/prompts.jsonl dataset.eval_path=/tmp/q17/eval.jsonl max_steps=10 output_dir=/tmp/q17/run eval.num_prompts=16 \
            && cp /tmp/q17/run/metrics.jsonl "$out/qwen17_metrics.jsonl" ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
esac
