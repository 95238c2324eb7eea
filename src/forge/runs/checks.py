"""Start-up checks of a GRPO run's inputs, made before any process starts.

Each would otherwise fail deep inside an actor, or worse, train on something wrong
without failing: a prompt too long for the trainer's sequence length. What the run talks to
outside is checked too: an environment's server (``Environment.check_before_run``: reachable,
with as many sessions as the run holds, the fields it reads) and the reward server (one request).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from forge.agents.config import load_agent_function
from forge.data.prompts import Row, load_prompt_rows
from forge.engines.generation import check_model_dir
from forge.grpo.config import GRPOConfig
from forge.runs.storage import check_writable_dir


def check_run_inputs(cfg: GRPOConfig) -> None:
    """Every check of a GRPO config's inputs, before any process
    starts, on what would otherwise fail deep inside an actor."""
    from transformers import AutoTokenizer

    check_model_dir(cfg.policy_path, "policy_path")
    check_outputs_spare_inputs(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.generator.model_path)  # the generator's
    check_policy_model(cfg, len(tokenizer))
    if cfg.distill is not None:
        check_policy_tokenizer(
            cfg.distill.teacher_path, "distill.teacher_path", "teacher", cfg.generator.model_path, tokenizer
        )
    if cfg.critic is not None and cfg.critic.path is not None:
        check_policy_tokenizer(cfg.critic.path, "critic.path", "critic", cfg.generator.model_path, tokenizer)
    train, evaluation = load_prompt_rows(cfg.dataset)  # raises on a missing column or no prompts
    seq_len, max_tokens = cfg.trainer.engine.training.seq_len, cfg.generator.sampling.max_tokens
    if cfg.agent is not None:
        load_agent_function(cfg.agent.function)  # its episodes' prompts are the agent's calls
    elif cfg.env is None:
        check_prompt_lengths(
            train,
            tokenizer,
            seq_len - max_tokens + 1,
            f"trainer.engine.training.seq_len {seq_len} - generator.sampling.max_tokens {max_tokens} + 1",
            "Raise trainer.engine.training.seq_len, lower generator.sampling.max_tokens",
            cfg.dataset.chat_template,
        )
    else:
        # The environment's class and params: an instance is built here. Its openings come from
        # reset, user code that may open a server session or a sandbox: measured here only for
        # an environment that opens with the row's prompt as it is (opens_with_row_prompt), and
        # otherwise as trajectories start, where one that fills env.max_tokens stops the run
        # naming the dataset row (forge.rollout.groups).
        from forge.envs.sessions import LocalEnvironments

        envs = LocalEnvironments(cfg.env.name, cfg.env.params, step_timeout_s=cfg.env.step_timeout_s)
        check_environment(cfg, envs.cls, train[0])
        if envs.cls.opens_with_row_prompt:
            budget = cfg.env.max_tokens or seq_len
            check_prompt_lengths(
                train,
                tokenizer,
                budget - 1,
                f"env.max_tokens {budget} - 1: the trajectory's budget, prompt and every turn, "
                "is trainer.engine.training.seq_len unless set",
                "Raise env.max_tokens (up to trainer.engine.training.seq_len)",
                cfg.dataset.chat_template,
                envs.cls(**envs.params).tools,
            )
    check_eval_set(evaluation, cfg.eval.every)
    if cfg.reward.remote is not None:
        check_reward_server(cfg.reward.remote, train[0])
    check_reward_models(cfg.reward.models)
    check_output_dirs(cfg)  # last: it creates output_dir, which a refused run should not leave


def check_environment(cfg: GRPOConfig, env_class, row: Row) -> None:
    """What the environment needs from outside (its server), checked with as many trajectories
    open at once as the run holds: each rollout thread's rows times group_size, and the eval's."""
    sessions = cfg.rollout.threads * cfg.rollout.samples
    if cfg.eval.every:
        sessions += cfg.eval.num_prompts
    try:
        asyncio.run(env_class.check_before_run(dict(cfg.env.params), sessions, row))
    except Exception as e:
        raise ValueError(f"env {cfg.env.name} failed its check before the run: {e}") from None


def check_reward_server(remote, row: Row) -> None:
    """The reward server scores one response (the first training row's prompt, answered with
    nothing) by its protocol, before the run."""
    from forge.rewards.remote import RemoteScorer

    scorer = RemoteScorer(remote)
    try:
        prompt = row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"])
        scorer.check((prompt, "", str(row.get("target", ""))))
    finally:
        scorer.close()


# What config.json's `architectures` of each kind of reward model ends with.
_REWARD_MODEL_HEADS = {
    "classifier": ("ForSequenceClassification",),
    "judge": ("ForCausalLM", "ForConditionalGeneration"),
}


def check_reward_models(models) -> None:
    """Each of `reward.models` (`forge.actors.reward.RewardModelConfig`) is a local model
    directory whose architecture fits its kind: a classifier needs a score head, a judge a
    language-model head."""
    import json

    for i, m in enumerate(models):
        key = f"reward.models[{i}].path"
        check_model_dir(m.path, key)
        architectures = json.loads((Path(m.path) / "config.json").read_text()).get("architectures") or []
        heads = _REWARD_MODEL_HEADS[m.kind]
        if not any(a.endswith(heads) for a in architectures):
            raise ValueError(
                f"{key}: '{m.path}' is a {architectures or 'model of unknown architecture'}, and reward model "
                f"'{m.name}' is a {m.kind}, which needs an architecture ending in {' or '.join(heads)} "
                "(config.json's architectures): point it at such a model, or change its kind"
            )


def check_output_dirs(cfg: GRPOConfig) -> None:
    """output_dir and the folders of the metric files must be writable (forge.runs.storage)."""
    metrics = cfg.metrics
    folders = {"output_dir": Path(cfg.output_dir)}
    for key in ("jsonl_path", "rollouts_path"):
        if getattr(metrics, key):
            folders[f"metrics.{key}"] = Path(getattr(metrics, key)).parent
    if metrics.tensorboard_dir:
        folders["metrics.tensorboard_dir"] = Path(metrics.tensorboard_dir)
    for key, folder in folders.items():
        check_writable_dir(folder, key)


def check_outputs_spare_inputs(cfg: GRPOConfig) -> None:
    """The run's export (output_dir/export) must not replace the model or tokenizer it starts
    from: refused when either directory holds the other."""
    export = (Path(cfg.output_dir) / "export").resolve()
    for key, value in (("policy_path", cfg.policy_path), ("generator.model_path", cfg.generator.model_path)):
        source = Path(value).resolve()
        if source == export or source.is_relative_to(export):
            raise ValueError(
                f"output_dir: the run exports to {export}, which would overwrite {key} ({value}), the "
                "model it starts from: choose another output_dir"
            )


def check_policy_model(cfg: GRPOConfig, tokenizer_size: int) -> None:
    """The trainer's model section against its checkpoint and the generator's tokenizer (of
    ``tokenizer_size`` tokens), and the generator's model against the trainer's: one policy,
    described alike by both."""
    from forge.engines.titan.checkpoint_model import (
        check_model_section,
        read_checkpoint_model,
        settings_differences,
    )

    model = cfg.trainer.engine.model
    trainer_model = check_model_section(
        model, "trainer.engine.model", tokenizer_size, cfg.generator.model_path
    )
    if trainer_model is None or not cfg.trainer.enabled:
        return
    generator_model = read_checkpoint_model(cfg.generator.model_path)
    differ = settings_differences(trainer_model.settings, generator_model.settings)
    if differ:
        raise ValueError(
            f"trainer.engine.model.hf_path ({model.hf_path}) and generator.model_path "
            f"({cfg.generator.model_path}) are different models: {'; '.join(differ)} (trainer vs "
            "generator). The generator samples the policy the trainer trains: point both at one checkpoint"
        )


def check_policy_tokenizer(path: str, key: str, role: str, policy_path: str, policy_tokenizer) -> None:
    """A model that scores the policy's samples (the teacher, `distill.teacher_path`; the critic,
    `critic.path`) is a checkpoint the trainer's engine loads, whose tokenizer is the policy's
    (`policy_path`, the generator's): it reads the token ids the policy samples, which mean the
    same text only under one tokenizer."""
    from transformers import AutoTokenizer

    from forge.engines.titan.checkpoint_model import check_tokenizer_fits, read_checkpoint_model

    check_model_dir(path, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{key}: no tokenizer loads from {path} ({error}); the {role} needs the policy's tokenizer "
            f"({policy_path}): copy its tokenizer files there"
        ) from None
    differences = tokenizer_differences(policy_tokenizer, tokenizer)
    if differences:
        raise ValueError(
            f"{key}: the {role}'s tokenizer ({path}) is not the policy's ({policy_path}): "
            f"{'; '.join(differences)} (policy vs {role}). The {role} reads the policy's token ids: "
            f"use a {role} that shares the policy's tokenizer"
        )
    check_tokenizer_fits(len(policy_tokenizer), read_checkpoint_model(path), path)


def tokenizer_differences(a, b) -> list[str]:
    """What differs between two tokenizers in what ids mean: sizes, tokens, special tokens."""
    differences = []
    if len(a) != len(b):
        differences.append(f"{len(a)} vs {len(b)} tokens")
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    changed = sorted(t for t in vocab_a.keys() | vocab_b.keys() if vocab_a.get(t) != vocab_b.get(t))
    if changed:
        shown = ", ".join(f"{t!r}: {vocab_a.get(t)} vs {vocab_b.get(t)}" for t in changed[:3])
        differences.append(f"{len(changed)} tokens have other ids (e.g. {shown})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(a, name) != getattr(b, name):
            differences.append(f"{name} {getattr(a, name)} vs {getattr(b, name)}")
    return differences


def check_prompt_lengths(
    rows: list[Row],
    tokenizer,
    limit: int,
    limit_is: str,
    advice: str,
    chat_template: str = "auto",
    tools: list[dict] | None = None,
) -> None:
    """Refuses prompts longer than `limit` tokens (what leaves room for a full response within
    the trainer's seq_len, which reads prompt + response minus the last token; or within an
    environment's trajectory budget), measured in the ids the generator samples from: rendered
    with `chat_template` (`dataset.chat_template`) and the environment's `tools`, which also
    refuses chat messages that no template can render. `limit_is` says what the limit is made
    of, `advice` which keys to change."""
    from forge.data.chat_prompts import PromptRenderer

    renderer = PromptRenderer(tokenizer, chat_template)
    rendered = [renderer.render(r["prompt"], tools) for r in rows]
    # Rows count from 1, in the dataset's order (a file's lines).
    too_long = [(len(p.ids), row, p.text) for row, p in enumerate(rendered, start=1) if len(p.ids) > limit]
    if too_long:
        longest, row, prompt = max(too_long, key=lambda item: (item[0], -item[1]))
        listed = ", ".join(str(r) for _, r, _ in too_long[:10]) + (", ..." if len(too_long) > 10 else "")
        raise ValueError(
            f"{len(too_long)} of {len(rows)} training prompts are longer than {limit} tokens "
            f"({limit_is}), rows {listed}; the longest, row {row}, has {longest}: {prompt[:80]!r}. "
            f"{advice}, or remove those prompts from the dataset"
        )


def check_eval_set(eval_rows: list[Row], every: int) -> None:
    if every > 0 and not eval_rows:
        raise ValueError(
            f"eval.every is {every} but the eval set is empty: set eval.every=0, or give eval prompts "
            "(dataset.eval_path, or dataset.toy_task.num_eval for the toy task)"
        )


def check_no_earlier_metrics(path: str | Path | None, key: str) -> None:
    """A run that starts afresh must not append its step 0 to the metrics of an earlier run in
    the same place (one that saved no checkpoint: with one, the checkpoint check refuses first)."""
    if path is not None and Path(path).is_file() and Path(path).stat().st_size > 0:
        raise ValueError(
            f"{path} ({key}) already holds the metrics of an earlier run, which saved no checkpoint "
            "to resume from: choose another output directory, or remove that file to start over"
        )
