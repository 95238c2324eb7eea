"""GRPO on the embedded task in one process, with forge's engines and losses but no actors:
on-policy, one optimizer step per rollout batch. For choosing the demo's settings quickly.
Prints greedy held-out accuracy every `--every` steps as a table.

    .venv/bin/python bench/grpo_inprocess.py --policy runs/sft_tiny_cpu/export --lr 3e-4 \
        --prompts 64 --group 16 --num-train 8000 --temperature 0.7 --steps 300
"""

import argparse
import random
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.data.rewards import exact_match, toy_task_reward
from forge.data.toy_task import ToyTaskConfig, make_splits
from forge.data.types import Completion, Episode
from forge.engines.generation import SamplingParams
from forge.engines.hf_generate import HFGenerateEngine
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.rl.advantage import group_advantages, has_signal
from forge.rl.batch import PolicyBatch
from forge.rl.losses import build_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="runs/sft_tiny_cpu/export")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--num-train", type=int, default=8000)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)

    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    trainer = TitanEngine(
        TitanEngineConfig.model_validate(
            {
                "model": {"flavor": "tiny", "hf_path": args.policy, "vocab_size": len(tokenizer)},
                "optimizer": {"lr": args.lr, "weight_decay": 0.0},
                "training": {"seq_len": 32},
            }
        )
    )
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32)
    generator = HFGenerateEngine(model, eos_token_id=tokenizer.eos_token_id)
    loss_fn = build_loss("grpo", clip_high=0.28, agg_type="token_mean", temperature=args.temperature)
    train, _ = make_splits(ToyTaskConfig(seed=0, num_train=args.num_train, num_eval=200))
    _, evaluation = make_splits(ToyTaskConfig(seed=0, num_train=2000, num_eval=200))

    def accuracy() -> float:
        ids = [tokenizer(r["prompt"]).input_ids for r in evaluation]
        out = generator.generate(ids, SamplingParams(temperature=0.0, max_tokens=6))
        texts = [tokenizer.decode(o[0].token_ids, skip_special_tokens=True) for o in out]
        return sum(exact_match("", t, r["target"]) for t, r in zip(texts, evaluation, strict=True)) / len(
            texts
        )

    rng = random.Random(0)
    rows = [(0, accuracy(), float("nan"), 0.0)]
    started = time.perf_counter()
    sampling = SamplingParams(n=args.group, temperature=args.temperature, max_tokens=6)
    for step in range(1, args.steps + 1):
        prompts = [rng.choice(train) for _ in range(args.prompts)]
        ids = [tokenizer(p["prompt"]).input_ids for p in prompts]
        episodes, rewards = [], []
        for prompt, prompt_ids, group in zip(prompts, ids, generator.generate(ids, sampling), strict=True):
            texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group]
            reward = torch.tensor([toy_task_reward(prompt["prompt"], t, prompt["target"]) for t in texts])
            rewards += reward.tolist()
            if not has_signal(reward):
                continue
            for s, text, advantage in zip(group, texts, group_advantages(reward).tolist(), strict=True):
                completion = Completion(
                    prompt["prompt"], prompt_ids, s.token_ids, s.logprobs, text, s.stop_reason, 0
                )
                episodes.append(Episode(completion, prompt["target"], "g", advantage=advantage))
        if episodes:
            trainer.train_step(PolicyBatch.from_episodes(episodes, tokenizer.pad_token_id), loss_fn)
            generator.load_hf_state_dict(trainer.hf_state_dict())
        if step % args.every == 0:
            rows.append((step, accuracy(), sum(rewards) / len(rewards), time.perf_counter() - started))

    print(
        f"in-process GRPO from {args.policy}: lr {args.lr}, {args.prompts} prompts x {args.group} samples, "
        f"{args.num_train} training problems, temperature {args.temperature}"
    )
    print("| step | held-out greedy accuracy | rollout reward | seconds |")
    print("|---:|---:|---:|---:|")
    for step, acc, reward, seconds in rows:
        print(f"| {step} | {acc:.3f} | {reward:.3f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
