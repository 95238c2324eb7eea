"""Start-up checks of a GRPO run's inputs, made before any process starts.

Each would otherwise fail deep inside an actor, or worse, train on something wrong
without failing: a prompt too long for the trainer's sequence length.
"""

from __future__ import annotations

from forge.data.prompts import Row, load_prompt_rows
from forge.engines.generation import check_model_dir


def check_run_inputs(cfg) -> None:
    """Every check of a GRPO config's inputs (`apps.grpo.config.GRPOConfig`), before any process
    starts, on what would otherwise fail deep inside an actor."""
    check_model_dir(cfg.policy_path, "policy_path")
    train, evaluation = load_prompt_rows(cfg.dataset)  # raises on a missing column or no prompts
    seq_len, max_tokens = cfg.trainer.engine.training.seq_len, cfg.generator.sampling.max_tokens
    check_prompt_lengths(train, cfg.generator.model_path, seq_len, max_tokens)
    check_eval_set(evaluation, cfg.eval.every)


def check_prompt_lengths(rows: list[Row], tokenizer_path: str, seq_len: int, max_tokens: int) -> None:
    """Refuses prompts that leave no room for a full response within the trainer's `seq_len`
    (the trainer reads prompt + response minus the last token)."""
    from transformers import AutoTokenizer

    limit = seq_len - max_tokens + 1
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows]).input_ids]
    too_long = [(n, r["prompt"]) for n, r in zip(lengths, rows, strict=True) if n > limit]
    if too_long:
        longest, prompt = max(too_long)
        raise ValueError(
            f"{len(too_long)} of {len(rows)} training prompts are longer than {limit} tokens "
            f"(trainer.engine.training.seq_len {seq_len} - generator.sampling.max_tokens {max_tokens} + 1); "
            f"the longest has {longest}: {prompt[:80]!r}. Raise trainer.engine.training.seq_len, lower "
            "generator.sampling.max_tokens, or remove those prompts from the dataset"
        )


def check_eval_set(eval_rows: list[Row], every: int) -> None:
    if every > 0 and not eval_rows:
        raise ValueError(
            f"eval.every is {every} but the eval set is empty: set eval.every=0, or give eval prompts "
            "(dataset.eval_path, or dataset.toy_task.num_eval for the toy task)"
        )
