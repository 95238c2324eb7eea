"""GRPO throughput at real model sizes: the whole app (every actor, the real weight sync) for a
few steps on Qwen3-shaped models with random weights (no checkpoint can be downloaded on the GPU
machines), with GPU utilization and memory sampled by nvidia-smi. Prints one table row per run.

    PYTHONPATH=src:. python bench/gpu_throughput.py --out DIR [--sizes 0.6B 1.7B] [--steps 8]
        [--engine hf|vllm] [--preset trl|long] [--variants age1-in_flight,age0-drain,...]
        [--placements 1gpu,2gpu-colocated,...] [override ...]

`--preset trl` is the work TRL's GRPOTrainer was measured on (bench/RESULTS.md): per optimizer
step 64 prompts of exactly 64 tokens x 8 samples of exactly 256 new tokens (the exported
tokenizer has no eos), 512 episodes trained, temperature 1.0. `--preset long` is the
same with 1,024 new tokens per sample and 128 episodes per step (the responses of reasoning
runs). Without either, the smaller workload of the first GPU runs (16 x 8 x 128 on toy-task prompts).

Each placement (PLACEMENTS) runs the app on the first N GPUs of the machine, spread as named
(the planner, forge.controller.gpu_plan, prints where each actor went); with several, the table
adds tokens/s per GPU and the scaling efficiency against the 1gpu run of the same size and variant.

Each variant (VARIANTS) is one run of the app; the overrides after the options apply to all.
The policy is torchtitan's flavor at its real vocabulary (151,936), exported to DIR with the
embedded character tokenizer (speed, not learning, is measured: every completion scores 0 and
groups are kept anyway). By default every actor shares GPU 0 (`provisioner.colocate=true`).

Columns, means over the timed steps (`--timed-from`, and never a step fed by the batches made
during the first step's start-up: with `max_policy_age` A, none before step A + 2; cut to whole
waves of the batches that arrive together, `batches_per_wave`):
- timed steps: the steps the means are over;
- s/step; tok/s: generated tokens trained per second, end to end (trained response tokens per
  step over the step time); in vain: the share of generated tokens evicted as stale;
- rollout: the samples of one rollout (one generate call, on one replica); given: the most
  samples the rollouts give a replica at once; running, running max: the samples a replica's vLLM
  ran at once, mean over its engine steps and most (fewer than given when its KV cache is full,
  and one rollout's under `drain` once the trainer is ahead);
- train s: the trainer's own step (forward, backward, optimizer);
- rollout s: a rollout's trajectories (its generate call, from the controller); score+add ms:
  its scoring and buffer calls after them; slot wait s: what the rollout loops waited per step
  for the staleness bound's room, summed over them (a loop's replica idles meanwhile);
- wait batch / sync wait: what the training loop waited for per step (a batch; its weight
  publish); load ms: vLLM's in-place load of a version; ready ms: from the trainer starting
  a publish to the generator sampling with it (one host: the CUDA IPC handle carries the time),
  over the replicas; last ready ms: the same for the last replica to be ready; ready ms by
  replica: each replica's (replica 0 first);
  these three are medians (the second version's load also checks the copy plan, once);
- sync MB: the bytes a weight publish moved (with LoRA: the adapters alone); merge ms: with
  `generator.lora_sync=merge`, the generator's merge of a version into its weights (before the load);
- GPU util %: mean over the timed steps; GPU mem GiB: peak over the run, per GPU.
- MPS: whether an MPS control daemon was listening where the run's processes look for one
  (`MPS=1 bash bench/device_runs.sh ...` starts it): the processes sharing a GPU then run their
  kernels at once instead of taking turns;
- tok/s/GPU: tok/s over the GPUs the run used; efficiency: tok/s/GPU over the 1gpu run's
  (the same size, preset, variant and MPS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from forge.config import load_config
from forge.grpo.config import GRPOConfig
from forge.runs.placement import rollouts_at_once, samples_given_per_replica

# One run each: the pipeline's staleness bound and how the generator takes new weights.
AGE0 = ["replay_buffer.max_policy_age=0", "rollout.threads=1"]
AGE1 = ["replay_buffer.max_policy_age=1", "rollout.threads=2"]
# Three steps' batches in flight: what keeps 4 replicas of a quarter of a step each busy.
AGE2 = ["replay_buffer.max_policy_age=2", "rollout.threads=3"]
# Four threads, one a replica of 4 running whole rollouts. max_policy_age 3 lets exactly 4 be made
# ahead, no slack: a replica whose rollout ends waits for a train step (bench/RESULTS.md, twentieth
# session); `replay_buffer.max_policy_age=4` after it gives the slack of a fifth slot, which its
# four loops leave empty (a loop starts its next rollout at once; age4-drain runs a fifth in it).
AGE3 = ["replay_buffer.max_policy_age=3", "rollout.threads=4"]
# Five: with 1,024-token responses a replica's decode steps are host work whatever its batch
# (bench/RESULTS.md, eleventh session), so more sequences in flight are the lever left.
AGE4 = ["replay_buffer.max_policy_age=4", "rollout.threads=5"]
IN_FLIGHT_KEEP = ["generator.update_mode=in_flight", "generator.vllm.in_flight_kv_cache=keep"]
LORA = [
    "trainer.engine.lora.rank=32",
    "trainer.engine.lora.alpha=64",
    "trainer.engine.optimizer.lr=1e-5",
    "trainer.engine.training.compile=false",
]
VARIANTS = {
    "age0-drain": AGE0 + ["generator.update_mode=drain"],
    "age0-in_flight": AGE0 + ["generator.update_mode=in_flight"],
    "age1-drain": AGE1 + ["generator.update_mode=drain"],
    "age1-in_flight": AGE1 + ["generator.update_mode=in_flight"],
    "age2-drain": AGE2 + ["generator.update_mode=drain"],
    "age3-drain": AGE3 + ["generator.update_mode=drain"],
    "age4-drain": AGE4 + ["generator.update_mode=drain"],
    # In flight with the running requests' caches kept: no pause at an update, so a replica
    # stays as full as the staleness bound allows (drain holds new requests back until its
    # running ones end, up to three 1,024-token batches in the `long` preset).
    "age2-in_flight-keep": AGE2 + IN_FLIGHT_KEEP,
    "age4-in_flight-keep": AGE4 + IN_FLIGHT_KEEP,
    # Within TRL's peak memory (55.9 GiB on an H200): activation checkpointing, a smaller
    # micro-batch and KV cache.
    "age1-in_flight-lowmem": AGE1
    + [
        "generator.update_mode=in_flight",
        "trainer.engine.training.activation_checkpoint=full",
        "trainer.engine.training.microbatch_tokens=8192",
        "generator.vllm.kv_cache_memory_gib=16",
    ],
    # vLLM sleeps through each train step (its KV cache freed, weights in host memory).
    "age0-sleep": AGE0 + ["generator.update_mode=drain", "generator.vllm.sleep_during_train=true"],
    # LoRA as configs/grpo/qwen3_8b_lora.yaml trains it (rank 32, alpha 64, every linear layer of
    # the blocks, not compiled), the adapters alone published, taken each way (issue 30: "whichever
    # is faster end to end; measure both"), against age1-drain's full fine-tuning.
    "age1-drain-lora-merge": AGE1 + ["generator.update_mode=drain", *LORA, "generator.lora_sync=merge"],
    "age1-drain-lora-vllm_lora": AGE1
    + ["generator.update_mode=drain", *LORA, "generator.lora_sync=vllm_lora"],
}


# How a run spreads over the first N GPUs of the machine: (N, trainer ranks, generator replicas,
# replicas per generator GPU, colocated[, vLLM tensor-parallel size]). Each rollout is a whole
# step's prompts on one replica (`placement_overrides`). `xK`: K replicas share each generator GPU,
# each with up to 80% / K of its memory (one vLLM loop keeps an H100 about half busy at 0.6B).
# `tpT`: each replica is one vLLM over T GPUs, against as many replicas of one GPU each (issue 28:
# "measured both ways").
PLACEMENTS = {
    "1gpu": (1, 1, 1, 1, True),
    "1gpu-x2": (1, 1, 2, 2, True),
    "2gpu-colocated": (2, 2, 2, 1, True),
    "2gpu-colocated-x2": (2, 2, 4, 2, True),
    "2gpu-disaggregated": (2, 1, 1, 1, False),
    "2gpu-disaggregated-x2": (2, 1, 2, 2, False),
    "4gpu-colocated": (4, 4, 4, 1, True),
    "4gpu-disaggregated": (4, 2, 2, 1, False),
    "4gpu-disaggregated-x2": (4, 2, 4, 2, False),
    "4gpu-disaggregated-x3": (4, 2, 6, 3, False),
    # At 0.6B two FSDP trainer GPUs idle half a step beside two saturated generator GPUs
    # (bench/RESULTS.md, seventh session): one trainer GPU, three generators (63 prompts a step).
    "4gpu-disaggregated-1+3": (4, 1, 3, 1, False),
    "2gpu-colocated-tp2": (2, 2, 1, 1, True, 2),
    "4gpu-colocated-tp2": (4, 4, 2, 1, True, 2),
    "4gpu-disaggregated-tp2": (4, 2, 1, 1, False, 2),
}


def placement_overrides(
    name: str, step_prompts: int, variant: list[str], split_rollouts: bool = False
) -> tuple[int, list[str]]:
    """The GPUs and overrides of placement `name`. Each rollout is a step's prompts (a train
    batch) on one replica, in as many rollout threads as the variant gives (at least one a
    replica): under `drain` a replica runs one rollout at a time once the trainer is ahead
    (bench/RESULTS.md, nineteenth session), so a rollout split over the replicas shrinks each
    one's batch. `split_rollouts`: every replica generates its share of each step's prompts, in
    the variant's threads each (the layout of the rows before; with 6 replicas a step then has
    60 prompts, not 64)."""
    gpus, procs, replicas, per_gpu, colocate, *tp = PLACEMENTS[name]
    threads = next((int(o.split("=")[1]) for o in variant if o.startswith("rollout.threads=")), 2)
    if split_rollouts:
        prompts, threads = step_prompts // replicas, threads * replicas
    else:
        prompts, threads = step_prompts, max(threads, replicas)
    shared = [
        f"generator.replicas_per_gpu={per_gpu}",
        f"generator.vllm.gpu_memory_utilization={0.8 / per_gpu:.2f}",
    ]
    return gpus, [
        f"provisioner.colocate={str(colocate).lower()}",
        f"trainer.procs={procs}",
        f"generator.replicas={replicas}",
        f"rollout.prompts_per_step={prompts}",
        f"rollout.threads={threads}",
        *(shared if per_gpu > 1 else []),
        *(f"generator.vllm.tensor_parallel_size={size}" for size in tp),
    ]


def export_random_policy(size: str, out: Path) -> Path:
    """torchtitan's `size` flavor, randomly initialised, as a Hugging Face directory in bf16."""
    from forge.data.tokenizer import embedded_tokenizer
    from forge.engines.titan.config import TitanEngineConfig
    from forge.engines.titan.engine import TitanEngine

    tokenizer_dir = out / "tokenizer"
    tokenizer = embedded_tokenizer()
    # No eos: every sample runs to max_tokens, as the presets' work says. (The engines sample
    # only the tokenizer's 55 rows of the 151,936, so an eos would end a sample every ~55 tokens.)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tokenizer_dir)
    config = {"model": {"flavor": size}, "training": {"seq_len": 512, "dtype": "bfloat16"}}
    engine = TitanEngine(TitanEngineConfig.model_validate(config), trainable=False)
    return engine.export_hf(out / "policy", tokenizer_dir)


def fixed_length_prompts(policy: Path, out: Path, length: int, count: int = 4096) -> Path:
    """A prompt file whose prompts are exactly `length` token ids each (no chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    path = out / f"prompts_{length}.jsonl"
    with path.open("w") as f:
        for i in range(count):
            text = f"{i}: " + "abcdefghij" * length
            ids = tokenizer(text)["input_ids"][:length]
            prompt = tokenizer.decode(ids, skip_special_tokens=True)
            if len(tokenizer(prompt)["input_ids"]) != length:
                raise RuntimeError(f"could not make a {length}-token prompt with {policy}'s tokenizer")
            f.write(json.dumps({"prompt": prompt, "target": "0"}) + "\n")
    return path


# What the trl preset needs at 1.7B to fit one 80 GB GPU beside vLLM (at micro-batch 16 the
# trainer held 56 GiB and ran out of memory on an H100; alone on an H200, packed micro-batches of
# 32k tokens peaked at 96 GiB, so half of that). From 4B on, as configs/grpo/qwen3_8b.yaml: each
# block's activations recomputed in the backward, which leaves the room for vLLM.
SMALLER_STEPS = ["trainer.engine.training.microbatch_tokens=16384", "generator.vllm.kv_cache_memory_gib=16"]
LARGER_MODELS = {
    "1.7B": SMALLER_STEPS,
    "4B": SMALLER_STEPS + ["trainer.engine.training.activation_checkpoint=full"],
    "8B": SMALLER_STEPS + ["trainer.engine.training.activation_checkpoint=full"],
}


# Per preset: new tokens per sample, prompts per step (8 samples each).
PRESETS = {"trl": (256, 64), "long": (1024, 16), None: (128, 16)}


def workload(policy: Path, out: Path, preset: str | None, size: str) -> list[str]:
    new_tokens, prompts_per_step = PRESETS[preset]
    if preset is not None:
        prompts = fixed_length_prompts(policy, out, 64)
        return [
            "dataset.source=file",
            f"dataset.path={prompts}",
            "dataset.chat_template=none",
            f"generator.sampling.max_tokens={new_tokens}",
            f"generator.vllm.max_model_len={64 + new_tokens + 64}",
            # vLLM checks at start-up that this share of the GPU is free (the trainer shares it);
            # its KV cache is the next line's size whatever the share.
            "generator.vllm.gpu_memory_utilization=0.3",
            "generator.vllm.kv_cache_memory_gib=32",
            f"trainer.engine.training.seq_len={64 + new_tokens}",
            f"trainer.loss.horizon={new_tokens}",
            f"rollout.prompts_per_step={prompts_per_step}",
            "rollout.group_size=8",
            f"replay_buffer.batch_size={prompts_per_step * 8}",
            *LARGER_MODELS.get(size, []),
        ]
    return [
        "dataset.source=toy_task",
        "dataset.path=null",
        f"generator.sampling.max_tokens={new_tokens}",
        f"trainer.engine.training.seq_len={2 * new_tokens}",
        f"trainer.loss.horizon={new_tokens}",
        f"rollout.prompts_per_step={prompts_per_step}",
        "rollout.group_size=8",
        f"replay_buffer.batch_size={prompts_per_step * 8}",
    ]


def config_lines(policy: Path, out: Path, size: str, engine: str, steps: int) -> list[str]:
    return [
        f"policy_path={policy}",
        f"output_dir={out}",
        f"max_steps={steps}",
        "generator.dtype=bfloat16",
        f"generator.engine={engine}",
        "generator.sampling.temperature=1.0",
        f"trainer.engine.model.flavor={size}",
        "trainer.engine.training.mixed_precision_param=bfloat16",
        # The trainer as bench/trainer_throughput.py measured it fastest: packed micro-batches of
        # 32k tokens, the model compiled, the fused AdamW.
        "trainer.engine.training.microbatch_tokens=32768",
        "trainer.engine.training.compile=true",
        "trainer.engine.optimizer.implementation=fused",
        "trainer.engine.optimizer.lr=1e-6",
        "trainer.loss.temperature=1.0",
        "rollout.skip_groups_without_signal=false",
        "eval.every=0",
        "provisioner.colocate=true",
        "metrics.rollouts_path=null",
        "metrics.tensorboard_dir=null",
        "checkpoint.every=0",
    ]


class GpuSampler:
    """nvidia-smi every 500 ms, each sample stamped with this machine's wall clock."""

    def __init__(self, gpus: int | None = None) -> None:
        self.samples: list[tuple[float, str, float, float]] = []  # (time, gpu, util %, MiB)
        self._process = None
        if shutil.which("nvidia-smi"):
            query = "--query-gpu=index,utilization.gpu,memory.used"
            only = [f"--id={','.join(str(i) for i in range(gpus))}"] if gpus else []
            self._process = subprocess.Popen(
                ["nvidia-smi", query, *only, "--format=csv,noheader,nounits", "-lms", "500"],
                stdout=subprocess.PIPE,
                text=True,
            )
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            index, util, mem = (field.strip() for field in line.split(","))
            self.samples.append((time.time(), index, float(util), float(mem)))

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()

    def summary(self, since: float, until: float) -> dict:
        gpus = sorted({s[1] for s in self.samples})
        if not gpus:
            return {}
        timed = [s for s in self.samples if since <= s[0] <= until]
        util = [statistics.mean([s[2] for s in timed if s[1] == g] or [float("nan")]) for g in gpus]
        peak = [max(s[3] for s in self.samples if s[1] == g) / 1024 for g in gpus]
        return {
            "GPU util %": " / ".join(f"{u:.0f}" for u in util),
            "GPU mem GiB": " / ".join(f"{m:.1f}" for m in peak),
        }


def first_steady_step(timed_from: int, max_policy_age: int) -> int:
    """The first step the means may include: `timed_from`, or later when the staleness bound
    A = `max_policy_age` is larger. Up to A + 1 batches of version 0 are made during the first
    step's start-up and compile, and they feed steps up to A + 1 whatever the generators' speed:
    an 8-step run at A = 4 timed from step 4 once read 32k tokens/s where its steps 6-8 made 24k."""
    return max(timed_from, max_policy_age + 2)


def batches_per_wave(cfg: GRPOConfig) -> int:
    """The train batches that arrive together. Every response of a preset is exactly its
    max_tokens long, so the samples that run at once end at once: one rollout a replica under
    `drain` (each new one waits for the newest policy), every rollout the staleness bound allows
    in flight. Steps then come in waves (whole rollouts on 2 replicas: 7.2, 2.0, 6.7, 2.3 s), and
    a mean over part of a wave misreads the rate (bench/RESULTS.md, nineteenth session)."""
    running = rollouts_at_once(cfg)
    if cfg.generator.update_mode == "drain":
        running = min(running, cfg.generator.replicas)
    return max(1, running * cfg.rollout.samples // cfg.replay_buffer.batch_size)


def summarize(label: str, rows: list[dict], gpu: GpuSampler, timed_from: int, wave: int = 1) -> dict:
    """Means over the steps from `timed_from`, cut to whole waves of `wave` steps."""
    timed = [r for r in rows if r["step"] >= timed_from] or rows
    timed = timed[: max(wave, len(timed) // wave * wave)]

    def over_steps(key: str, of=statistics.mean) -> float:
        values = [r[key] for r in timed if key in r]
        return of(values) if values else float("nan")

    step_s = over_steps("grpo/step_s")
    replicas = sorted(
        {k for r in timed for k in r if k.startswith("generator/replica_")},
        key=lambda k: int(k.split("/")[1].removeprefix("replica_")),
    )
    generated = sum(r.get("generator/generated_tokens", 0) for r in rows)
    in_vain = sum(r.get("buffer/evicted_stale_tokens", 0) for r in rows)
    previous = next((r for r in rows if r["step"] == timed_from - 1), rows[0])
    return {
        "run": label,
        "timed steps": f"{timed[0]['step']}-{timed[-1]['step']}",
        "s/step": step_s,
        "tok/s": over_steps("train/response_tokens") / step_s,
        "in vain": in_vain / generated if generated else 0.0,
        # What vLLM ran at once, a replica: fewer than the rollout gives it when its KV cache is full.
        "running": over_steps("generator/running_samples"),
        "running max": over_steps("generator/running_samples_max", max),
        "train s": over_steps("trainer/step_s"),
        "wait batch ms": over_steps("grpo/wait_batch_ms"),
        # A rollout loop's cycle: its trajectories (the generate call), then its scoring and buffer
        # calls, then its wait for the staleness bound's room (summed over the loops), while its
        # replica has nothing of it to run.
        "rollout s": over_steps("rollout/trajectories_s"),
        "score+add ms": (over_steps("rollout/score_s") + over_steps("rollout/add_s")) * 1e3,
        "slot wait s": over_steps("rollout/wait_for_slot_s"),
        "sync wait ms": over_steps("grpo/weight_sync_ms"),
        # Medians: the second version's load also checks the copy plan against vLLM's loader.
        "load ms": over_steps("generator/weight_load_ms", statistics.median),
        "ready ms": over_steps("generator/publish_to_ready_ms", statistics.median),
        "last ready ms": over_steps("generator/publish_to_ready_max_ms", statistics.median),
        "ready ms by replica": " / ".join(f"{over_steps(k, statistics.median):.0f}" for k in replicas) or "-",
        "sleep+wake ms": over_steps("generator/sleep_ms") + over_steps("generator/wake_ms"),
        # What a publish moved (the adapters alone with LoRA) and, merging on arrival, the merge.
        "sync MB": over_steps("weight_sync/publish_bytes") / 1e6,
        "merge ms": over_steps("generator/lora_merge_ms", statistics.median),
        **gpu.summary(previous["time"], timed[-1]["time"]),
    }


def run(
    size: str,
    engine: str,
    label: str,
    steps: int,
    out: Path,
    preset: str | None,
    overrides: list[str],
    placement: str | None = None,
    timed_from: int = 3,
    split_rollouts: bool = False,
) -> dict:
    root = out / size
    policy = root / "policy"
    if not (policy / "config.json").exists():  # in a child: the export's process group stays there
        subprocess.run([sys.executable, __file__, "--export", size, str(root)], check=True)
    run_dir = root / (f"run_{engine}_{label}" + (f"_{placement}" if placement else ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo/qwen3_1_7b.yaml"]
    command += config_lines(policy, run_dir, size, engine, steps) + workload(policy, root, preset, size)
    command += VARIANTS.get(label, [])
    env = dict(os.environ)
    gpus = None
    if placement is not None:
        gpus, placed = placement_overrides(
            placement, PRESETS[preset][1], VARIANTS.get(label, []), split_rollouts
        )
        command += placed
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    command += overrides
    gpu = GpuSampler(gpus)
    try:
        subprocess.run(command, check=True, env=env)
    finally:
        gpu.stop()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    used = load_config(GRPOConfig, run_dir / "config.yaml", [])  # the config the app saved
    where = {"placement": placement, "GPUs": gpus} if placement else {}
    timed_from = first_steady_step(timed_from, used.replay_buffer.max_policy_age)
    return {
        "size": size,
        "preset": preset,
        **where,
        "MPS": "on" if mps_listening() else "off",
        "rollout": used.rollout.samples,
        "given": samples_given_per_replica(used),
        **summarize(label, [r for r in rows if r["step"] >= 1], gpu, timed_from, batches_per_wave(used)),
    }


def mps_listening() -> bool:
    """Whether CUDA clients started from here would find an MPS control daemon: its pipe is where
    CUDA_MPS_PIPE_DIRECTORY (by default /tmp/nvidia-mps) says."""
    return (Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control").exists()


def add_scaling(results: list[dict]) -> None:
    """tok/s per GPU, and the efficiency against the 1gpu run of the same size, variant and MPS.
    The rows of earlier invocations (results.json accumulates) count as bases too."""
    for row in results:
        if "GPUs" not in row:
            continue
        row["tok/s/GPU"] = row["tok/s"] / row["GPUs"]
        base = next(
            (
                b
                for b in results
                if b.get("placement") == "1gpu"
                and all(b.get(key) == row.get(key) for key in ("size", "preset", "run", "MPS"))
            ),
            None,
        )
        if base is not None:
            row["efficiency"] = f"{row['tok/s/GPU'] / (base['tok/s'] / base['GPUs']):.0%}"


def print_table(results: list[dict]) -> None:
    columns = list(dict.fromkeys(key for row in results for key in row))
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in results:
        cells = []
        for column in columns:
            value = row.get(column, "")
            if isinstance(value, float):
                value = "-" if value != value else f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
            cells.append(str(value))
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", nargs="+", default=["0.6B", "1.7B"])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preset", choices=["trl", "long"], default=None)
    # The first steps of a compiled trainer include its compiles (one per new range of lengths).
    parser.add_argument("--timed-from", type=int, default=3, help="the first step of the means")
    parser.add_argument(
        "--placements",
        type=lambda text: text.split(","),
        default=[None],
        help=f"comma-separated, of {list(PLACEMENTS)}; default: the run's own config (every actor on GPU 0)",
    )
    parser.add_argument(
        "--variants",
        type=lambda text: text.split(","),
        default=["default"],
        help=f"comma-separated, of {sorted(VARIANTS)}, or default",
    )
    parser.add_argument(
        "--split-rollouts",
        action="store_true",
        help="every replica generates its share of each step's prompts (the rows before the nineteenth session)",
    )
    args, overrides = parser.parse_known_args()
    unknown = [v for v in args.variants if v != "default" and v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {sorted(VARIANTS)} or default")
    unplaced = [p for p in args.placements if p is not None and p not in PLACEMENTS]
    if unplaced:
        parser.error(f"unknown placements {unplaced}: choose from {list(PLACEMENTS)}")
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    for size in args.sizes:
        for label in args.variants:
            for placement in args.placements:
                results.append(
                    run(
                        size,
                        args.engine,
                        label,
                        args.steps,
                        args.out,
                        args.preset,
                        overrides,
                        placement,
                        args.timed_from,
                        args.split_rollouts,
                    )
                )
                add_scaling(results)
                results_path.write_text(json.dumps(results, indent=1))
                print_table(results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--export"]:  # the child that `run` starts: --export SIZE DIR
        export_random_policy(sys.argv[2], Path(sys.argv[3]))
    else:
        main()
