#!/usr/bin/env bash
# The runs made on the GPU machines, one per device call on a machine where the core and vLLM
# wheel sets are installed (bench/RESULTS.md), back to back. Logs land in OUT_DIR.
#
#   bash bench/device_runs.sh RUN OUT_DIR [ARGS...]
#
#   app SIZE VARIANTS STEPS [override ...]
#               bench/gpu_throughput.py on GPU 0 (every actor there), vLLM, the trl preset; keeps
#               each run's metrics.jsonl, the trainer's profile (trainer.profile_step=N) and the
#               log with torch.compile's recompiles.
#   lora SIZE STEPS [override ...]
#               `app` with full fine-tuning (age1-drain) and LoRA (rank 32, all linear layers) whose
#               adapters the generator merges (age1-drain-lora-merge) or vLLM serves as a LoRA
#               (age1-drain-lora-vllm_lora): the comparison of issue 30's sync modes
#   lora8b [override ...]
#               issue 30's 8B run: `app` at 8B with LoRA merged on arrival, 10 steps, with
#               configs/grpo/qwen3_8b_lora.yaml's micro-batches (4k tokens) and KL term (beta 0.01,
#               the reference from the trainer's adapters off) and an 8 GiB KV cache
#   scaling SIZE PRESET PLACEMENTS  bench/gpu_throughput.py on the placements (comma-separated,
#               of its PLACEMENTS: 1gpu, 2gpu-colocated, ...), vLLM, VARIANT (age1-drain), STEPS steps (6)
#               timed from step TIMED_FROM (3); results.json and each run's metrics to OUT_DIR
#   vllm_tp TP  vLLM with tensor_parallel_size=TP: generation, updates, parity (bench/vllm_tp_check.py)
#   in_flight [ARGS...]
#               in-flight weight updates with vLLM's asynchronous scheduling: each token's version
#               against its logprob (bench/in_flight_check.py; ARGS, e.g. --caches keep, go to it)
#   engine_core SIZE [ARGS...]
#               plain vLLM with its engine core in this process (forge's way) and in a process of
#               its own (vLLM's serving default), one `bench/vllm_generate_bench.py --part sampling`
#               each, at once on GPUs 0 and 1, GRPO's sampling and no logprobs, the trl preset's
#               work for one replica; ARGS go to the bench (--tiny: a CPU dry run)
#   broadcast SENDERS RECEIVERS GB
#               the broadcast weight transport over NCCL, a process per GPU: versions of GB GB
#               (3.4: Qwen3-1.7B in bf16; 16.4: Qwen3-8B), a receiver killed mid-transfer and
#               its replacement (bench/broadcast_check.py)
#   fsdp        trainer.procs=2, generator colocated, KL on; losses against one GPU's on the
#               same batches (bench/fsdp_parity.py)
#   demo        configs/grpo/gpu_demo.yaml, trainer on GPU 0 and generator on GPU 1
#   contexts    which processes hold a CUDA context on which GPU (nvidia-smi every 2 s) through a
#               tiny GRPO run with the trainer over GPUs 0-1 and the hf generator on GPU 2: a trainer
#               rank on another rank's GPU is the leak forge.cuda_threads closes (core set only)
#   config SIZE CONFIG [override ...]
#               a shipped config as it is (its placement, memory shares, micro-batches) on the
#               toy task with a random policy of SIZE, 10 steps; e.g. 1.7B configs/grpo/qwen3_1_7b.yaml
#               (trainer and generator on a GPU each), 8B configs/grpo/qwen3_8b.yaml (4 GPUs of 80 GB)
#
# MPS=1 (app, scaling): the processes that share a GPU (replicas_per_gpu > 1, a trainer rank beside
# a replica) share it through NVIDIA's Multi-Process Service, a control daemon started here with its
# pipes under /tmp and stopped at the end, so that their kernels run at once instead of taking
# turns. The card's settings (compute mode among them) stay as they are.
set -uo pipefail
run=${1:?usage: bench/device_runs.sh app|lora|lora8b|scaling|in_flight|vllm_tp|engine_core|broadcast|fsdp|demo|contexts|config OUT_DIR [ARGS...]}
out=${2:?usage: bench/device_runs.sh RUN OUT_DIR [ARGS...]}
shift 2
mkdir -p "$out"
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null
# On a card under 100 GB, micro-batches of 16k tokens and a 20 GiB KV cache (32k and 32 GiB,
# the bench's own settings, need about 93 GiB beside each other at 0.6B).
memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null || echo 0)
small=()
if [ "$memory" -lt 100000 ]; then
    small=(trainer.engine.training.microbatch_tokens=16384 generator.vllm.kv_cache_memory_gib=20)
    echo "a ${memory} MiB card: ${small[*]}"
fi
start_mps() {
    [ "${MPS:-0}" = 1 ] || return 0
    if ! command -v nvidia-cuda-mps-control >/dev/null; then
        echo "MPS=1: nvidia-cuda-mps-control is not on this machine; run without MPS" >&2
        exit 2
    fi
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || exit
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    echo "MPS: control daemon started (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
}
case $run in
    app)
        start_mps
        size=${1:?app SIZE VARIANTS STEPS} variants=${2:?} steps=${3:?}
        shift 3
        TORCH_LOGS=recompiles timeout "${TIME_LIMIT:-3600}" "$PYTHON" bench/gpu_throughput.py --out /tmp/app \
            --engine vllm --preset trl --sizes "$size" --steps "$steps" --variants "$variants" "${small[@]}" "$@" \
            > "$out/app.log" 2>&1
        status=$?
        for run_dir in /tmp/app/"$size"/run_*; do  # flat: the device returns shallow folders only
            cp "$run_dir/metrics.jsonl" "$out/${run_dir##*/}.metrics.jsonl"
            for file in "$run_dir"/profile/*; do [ -e "$file" ] && cp "$file" "$out/${run_dir##*/}.${file##*/}"; done
        done
        cp /tmp/app/results.json "$out/" 2>/dev/null
        grep -i "recompil" "$out/app.log" | tail -20
        tail -30 "$out/app.log"
        exit $status ;;
    lora)
        size=${1:?lora SIZE STEPS} steps=${2:?lora SIZE STEPS}
        shift 2
        exec bash "$0" app "$out" "$size" age1-drain,age1-drain-lora-merge,age1-drain-lora-vllm_lora "$steps" "$@" ;;
    lora8b)
        exec bash "$0" app "$out" 8B age1-drain-lora-merge 10 trainer.engine.training.microbatch_tokens=4096 \
            generator.vllm.kv_cache_memory_gib=8 trainer.loss.beta=0.01 "$@" ;;
    scaling)
        start_mps
        size=${1:?scaling SIZE PRESET PLACEMENTS} preset=${2:?} placements=${3:?}
        shift 3
        # TIME_LIMIT: seconds for all of them; the rows finished by then are kept.
        timeout "${TIME_LIMIT:-3600}" "$PYTHON" bench/gpu_throughput.py --out /tmp/scaling --engine vllm \
            --preset "$preset" --sizes "$size" --steps "${STEPS:-6}" --timed-from "${TIMED_FROM:-3}" \
            --variants "${VARIANT:-age1-drain}" --placements "$placements" "${small[@]}" "$@"
        status=$?
        cp /tmp/scaling/results.json "$out/" 2>/dev/null
        for run_dir in /tmp/scaling/"$size"/run_*; do
            [ -e "$run_dir/metrics.jsonl" ] && cp "$run_dir/metrics.jsonl" "$out/${run_dir##*/}.metrics.jsonl"
        done
        exit $status ;;
    in_flight) "$PYTHON" bench/in_flight_check.py --out "$out/in_flight" "$@" ;;
    vllm_tp) "$PYTHON" bench/vllm_tp_check.py --out /tmp/vllm_tp --size 0.6B --tp "${1:-2}" ;;
    engine_core)
        size=${1:?engine_core SIZE [ARGS...]}
        shift
        for multiprocessing in 0 1; do
            CUDA_VISIBLE_DEVICES=$multiprocessing VLLM_ENABLE_V1_MULTIPROCESSING=$multiprocessing \
                "$PYTHON" bench/vllm_generate_bench.py --part sampling --only "GRPO default,no logprobs" \
                --flavor "$size" --prompts 64 --n 8 --max-tokens 256 --gpu-memory-utilization 0.4 \
                --model-dir "/tmp/engine_core_model_$multiprocessing" --results "$out/core_$multiprocessing.jsonl" \
                "$@" > "$out/core_$multiprocessing.log" 2>&1 &
        done
        wait
        for multiprocessing in 0 1; do "$PYTHON" bench/vllm_generate_bench.py --table --results "$out/core_$multiprocessing.jsonl"; done ;;
    broadcast) "$PYTHON" bench/broadcast_check.py --senders "${1:-2}" --receivers "${2:-2}" --gb "${3:-3.4}" ;;
    fsdp) "$PYTHON" bench/fsdp_parity.py --out "$out/fsdp" --procs 2 && cp "$out/fsdp/losses.json" "$out/" ;;
    demo) bash bench/gpu_demo.sh "$out/demo" provisioner.colocate=false ;;
    contexts)
        (while true; do echo "== $(date +%T)"; nvidia-smi --query-compute-apps=gpu_bus_id,pid,used_memory --format=csv,noheader; sleep 2; done) > "$out/apps.log" 2>&1 &
        sampler=$!
        timeout 170 "$PYTHON" -m apps.grpo.main --config configs/grpo/tiny_cpu.yaml trainer.procs=2 \
            provisioner.colocate=false generator.engine=hf max_steps=8 output_dir=/tmp/contexts \
            metrics.console=true eval.every=0 > "$out/run.log" 2>&1
        status=$?
        kill $sampler
        nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader
        awk '!/^==/' "$out/apps.log" | sort -u
        exit $status ;;
    config)
        size=${1:?config SIZE CONFIG [override ...]} config=${2:?config SIZE CONFIG [override ...]}
        shift 2
        "$PYTHON" bench/gpu_throughput.py --export "$size" /tmp/cfg || exit
        "$PYTHON" -c "
from forge.data.toy_task import ToyTaskConfig, make_splits, write_jsonl
train, evaluation = make_splits(ToyTaskConfig())
write_jsonl(train, '/tmp/cfg/prompts.jsonl'), write_jsonl(evaluation, '/tmp/cfg/eval.jsonl')
" || exit
        # The console's step lines on (the shipped configs write metrics to their jsonl only); the
        # metrics come back even from a run stopped by the device's time limit. A random policy
        # scores every sample alike: its groups are kept.
        TORCH_LOGS=recompiles timeout "${TIME_LIMIT:-3600}" "$PYTHON" -m apps.grpo.main \
            --config "$config" policy_path=/tmp/cfg/policy metrics.console=true \
            dataset.path=/tmp/cfg/prompts.jsonl dataset.eval_path=/tmp/cfg/eval.jsonl max_steps=10 \
            output_dir=/tmp/cfg/run eval.num_prompts=16 rollout.skip_groups_without_signal=false "$@"
        status=$?
        cp /tmp/cfg/run/metrics.jsonl "$out/config_metrics.jsonl"
        exit $status ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
esac
