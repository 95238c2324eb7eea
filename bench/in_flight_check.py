"""In-flight weight updates through forge's `VLLMEngine` as they run on a GPU, where vLLM schedules
asynchronously (a step is launched before the last one's tokens come back): is every token
stamped with the weights that produced it? Prints a table.

    PYTHONPATH=src:. python bench/in_flight_check.py --out DIR [--dtype bfloat16] [--caches keep,recompute]

Two small Qwen3 checkpoints made by transformers (seeds 0 and 1, weights drawn wide enough that
their next-token distributions differ) are written to DIR. For each way of treating the running
requests' caches (`generator.vllm.in_flight_kv_cache`), an engine starts on the first, samples,
and takes the second as version 1 after the engine thread's `--switch-at`-th step, while the
requests run. Each sample's tokens are stamped 0 up to some index s and 1 from there. A float32
transformers forward gives what each token's logprob must be if the switch was at s: the old
weights before it; after it, the new weights over keys and values the old ones wrote (`keep`) or
over their own (`recompute`). The table gives the largest gap to that reference, and the
smallest largest gap if the switch were one token earlier or later: the stamps are right when
the first is at the dtype's rounding and the second far above it. On CPU vLLM steps
synchronously; the run there only checks this script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from pathlib import Path

import torch

from forge.engines.generation import SamplingParams

TEMPERATURE = 1.0
PROMPTS = [[1] + [5 + (7 * i + j) % 40 for j in range(length)] for i, length in enumerate((8, 20, 150, 40))]


def save_model(path: Path, seed: int, tokenizer) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        # Wide weights: peaked next-token distributions, so that two seeds' logprobs differ far
        # beyond bf16's rounding.
        initializer_range=0.2,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def reference(
    old,
    new,
    prompt: list[int],
    response: list[int],
    switch: int,
    cache: str,
    temperature: float = TEMPERATURE,
) -> torch.Tensor:
    """Each response token's logprob under transformers models `old` and `new`, if the weights
    changed from one to the other after `switch` tokens."""
    from forge.rl.ops import compute_logprobs

    def logprobs_of(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
        return compute_logprobs(logits, torch.tensor([targets]), temperature)[0]

    sequence = torch.tensor([prompt + response[:-1]])
    with torch.no_grad():
        before = logprobs_of(old(sequence).logits[:, len(prompt) - 1 :], response)
        if switch >= len(response):
            return before
        if cache == "recompute" or switch == 0:
            after = logprobs_of(new(sequence).logits[:, len(prompt) - 1 :], response)[switch:]
        else:  # the last token sampled before the switch enters the model after it
            kept = old(torch.tensor([prompt + response[: switch - 1]]), use_cache=True).past_key_values
            logits = new(torch.tensor([response[switch - 1 : -1]]), past_key_values=kept).logits
            after = logprobs_of(logits, response[switch:])
    return torch.cat([before[:switch], after])


class StepGate:
    """Holds vLLM's engine thread at its `at`-th step (before the step runs) until released, so
    that an update sent meanwhile lands after that step while requests run, whatever the
    machine's speed."""

    def __init__(self, engine, at: int):
        self.llm_engine, self.at, self.steps = engine._llm.llm_engine, at, 0
        self.reached, self.release = threading.Event(), threading.Event()
        self._step = self.llm_engine.step
        self.llm_engine.step = self.step

    def step(self):
        self.steps += 1
        if self.steps == self.at:
            self.reached.set()
            if not self.release.wait(timeout=300):
                raise RuntimeError("the engine was never released")
        return self._step()

    def remove(self) -> None:
        self.llm_engine.step = self._step


def update_mid_request(engine, prompts, params: SamplingParams, new_weights, at: int):
    """Samples `prompts` and loads `new_weights` as version 1 after the engine thread's `at`-th
    step, while they run; then samples them again. Returns both calls' results."""
    gate = StepGate(engine, at)

    async def main():
        running = asyncio.create_task(engine.generate_async(prompts, params))
        await asyncio.to_thread(gate.reached.wait, 300)
        update = asyncio.create_task(engine.load_hf_state_dict_async(new_weights, 1))
        await asyncio.sleep(0.2)  # the update is queued while the engine is held mid-request
        gate.release.set()
        await update
        later = await engine.generate_async(prompts, params)
        return await running, later

    try:
        return asyncio.run(main())
    finally:
        gate.remove()


def check(cache: str, paths: tuple[str, str], args, tokenizer) -> dict:
    from transformers import AutoModelForCausalLM

    from forge.engines.vllm import VLLMEngine
    from forge.engines.vllm_config import VLLMConfig

    config = VLLMConfig(
        kv_cache_memory_gib=1 if torch.cuda.is_available() else 0.1,
        gpu_memory_utilization=0.3,
        max_model_len=256,
        in_flight_kv_cache=cache,
    )
    engine = VLLMEngine(paths[0], config, dtype=args.dtype, tokenizer=tokenizer, update_mode="in_flight")
    queued = engine._steps._queue is not None
    old, new = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in paths)
    params = SamplingParams(n=4, temperature=TEMPERATURE, max_tokens=args.max_tokens, seed=3)
    result, _ = update_mid_request(engine, PROMPTS, params, new.state_dict(), args.switch_at)
    engine.close()
    stamped_gap, other_gap, switches = 0.0, float("inf"), []
    for prompt, group in zip(PROMPTS, result.samples, strict=True):
        for sample in group:
            versions = sample.token_versions or [result.version] * len(sample.token_ids)
            switch = versions.count(0)
            if versions != [0] * switch + [1] * (len(versions) - switch):
                raise AssertionError(f"versions out of order: {versions}")
            switches.append(switch)
            got = torch.tensor(sample.logprobs)

            def gap(at: int, prompt=prompt, sample=sample, got=got) -> float:
                return (got - reference(old, new, prompt, sample.token_ids, at, cache)).abs().max().item()

            stamped_gap = max(stamped_gap, gap(switch))
            for other in (switch - 1, switch + 1):
                if 0 <= other <= len(versions):
                    other_gap = min(other_gap, gap(other))
    return {
        "cache": cache,
        "dtype": args.dtype,
        "asynchronous scheduling": queued,
        "switch index (min..max)": f"{min(switches)}..{max(switches)}",
        "max gap, stamped versions": round(stamped_gap, 4),
        "max gap, switch one token off (least)": round(other_gap, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--caches", default="keep,recompute")
    parser.add_argument(
        "--switch-at", type=int, default=12, help="the engine step after which the update lands"
    )
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    from forge.data.tokenizer import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    paths = (save_model(args.out / "old", 0, tokenizer), save_model(args.out / "new", 1, tokenizer))
    rows = [check(cache, paths, args, tokenizer) for cache in args.caches.split(",")]
    (args.out / "in_flight_check.json").write_text(json.dumps(rows, indent=1))
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
