"""Bad input to the GRPO app fails at start-up with a message naming what to fix."""

import json
import shutil
import socket
from pathlib import Path

import pytest
from apps.grpo.main import main
from startup_errors import startup_error

from forge.data.tokenizer import embedded_tokenizer


def run_expecting_exit(capsys, argv) -> str:
    return startup_error(main, capsys, argv)


def test_missing_model_path(write_grpo_config, tmp_path, capsys):
    missing = tmp_path / "no_such_policy"
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), f"policy_path={missing}"])
    assert f"policy_path: model directory '{missing}' does not exist" in err


def test_empty_dataset(write_grpo_config, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "dataset.source=file", f"dataset.path={empty}"]
    )
    assert str(empty) in err and "empty" in err


def test_dataset_file_without_target_column(write_grpo_config, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "dataset.source=file", f"dataset.path={rows}"]
    )
    assert str(rows) in err and "target" in err and "dataset.target_column" in err


def test_unknown_loss_name(write_grpo_config, capsys):
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), "trainer.loss.name=grpoo"])
    assert "trainer.loss" in err and "unknown loss 'grpoo'" in err and "grpo, dapo" in err


def test_misspelled_loss_parameter(write_grpo_config, capsys):
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), "trainer.loss.clip_lo=0.1"])
    assert "clip_lo" in err


def test_a_loss_section_in_the_old_params_shape_says_what_to_write(write_grpo_config, capsys):
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "trainer.loss.params={beta: 0.1}"]
    )
    assert "trainer.loss" in err and "not under `params`" in err and "trainer.loss.beta=0.1" in err


def test_unknown_reward_function(write_grpo_config, capsys):
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "reward.functions=[{name: exact_matc}]"]
    )
    assert "unknown reward function 'exact_matc'. Did you mean 'exact_match'?" in err


def test_temperature_mismatch(write_grpo_config, capsys):
    err = run_expecting_exit(
        capsys,
        [
            "--config",
            str(write_grpo_config()),
            "trainer.loss.temperature=1.0",
            "generator.sampling.temperature=0.7",
        ],
    )
    assert "must equal generator.sampling.temperature" in err


def test_unknown_eval_reward_function(write_grpo_config, capsys):
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), "eval.reward_fn=exact_mach"])
    assert (
        "eval.reward_fn" in err and "unknown reward function 'exact_mach'. Did you mean 'exact_match'?" in err
    )


def test_policy_path_at_a_run_directory_names_its_export(write_grpo_config, tmp_path, capsys, tiny_policy):
    run_dir = tmp_path / "earlier_run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "export").symlink_to(tiny_policy, target_is_directory=True)
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), f"policy_path={run_dir}"])
    assert f"policy_path: '{run_dir}' has no config.json" in err
    assert f"it looks like a run's directory, whose exported model is policy_path={run_dir}/export" in err


def test_bad_vllm_settings(write_grpo_config, capsys):
    # The test config samples 4 tokens: a context of 4 leaves no room for the prompt.
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), "generator.vllm.max_model_len=4"])
    assert "generator.vllm.max_model_len (4) must exceed generator.sampling.max_tokens (4)" in err
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "generator.vllm.gpu_memory_utilisation=0.5"]
    )
    assert "gpu_memory_utilisation" in err and "gpu_memory_utilization" in err
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), "generator.engine=vllmm"])
    assert "generator.engine" in err
    # A KV cache too small for one sample of max_model_len, which vLLM would refuse in its actor.
    small = [
        "generator.engine=vllm",
        "generator.vllm.kv_cache_memory_gib=0.001",
        "generator.vllm.max_model_len=4096",
    ]
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), *small])
    assert (
        "generator.vllm.kv_cache_memory_gib 0.001 holds 2,097 tokens" in err and "max_model_len 4,096" in err
    )


def test_prompts_too_long_for_the_trainer(write_grpo_config, capsys):
    # The toy prompts are about 7 tokens: 8 - 4 + 1 leaves room for 5.
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "trainer.engine.training.seq_len=8"]
    )
    assert "training prompts are longer than 5 tokens" in err and "trainer.engine.training.seq_len 8" in err


def test_a_too_long_prompt_is_named_by_its_row(write_grpo_config, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    prompts = ["1+1=", "2+2=", "3+3=" * 40, "4+4="]
    rows.write_text("".join(json.dumps({"prompt": p, "target": "0"}) + "\n" for p in prompts))
    err = refused_before_start(
        capsys, write_grpo_config(), "dataset.source=file", f"dataset.path={rows}", "eval.every=0"
    )
    assert "1 of 4 training prompts are longer than" in err and "rows 3; the longest, row 3, has 161" in err


def test_prompts_that_fill_a_tool_environments_budget_are_refused_before_start(write_grpo_config, capsys):
    # The tool environment opens with the row's prompt (about 7 tokens templated): a budget of 6
    # leaves it no room. Environments that open otherwise are measured as trajectories start.
    config = write_grpo_config(env="{name: 'forge.envs.tool_env:ToolEnvironment', max_tokens: 6}")
    err = refused_before_start(capsys, config)
    assert "training prompts are longer than 5 tokens (env.max_tokens 6 - 1" in err
    assert "Raise env.max_tokens (up to trainer.engine.training.seq_len), or remove those prompts" in err


def test_an_environment_server_or_reward_server_that_is_down_is_refused_before_start(
    write_grpo_config, capsys
):
    """What a run talks to outside is checked before any process starts (the checks themselves:
    tests/envs/test_openenv.py and tests/data/test_remote_reward.py)."""
    pytest.importorskip("openenv.core", reason="needs openenv-core (make install)")
    down = f"http://127.0.0.1:{free_port()}"
    env = f"{{name: 'forge.envs.openenv:OpenEnvEnvironment', params: {{base_url: '{down}'}}}}"
    err = refused_before_start(capsys, write_grpo_config(env=env))
    assert err.startswith("env forge.envs.openenv:OpenEnvEnvironment failed its check before the run: with ")
    assert f"cannot reach an OpenEnv server at '{down}'" in err
    reward = f"{{functions: [{{name: toy_task}}], remote: {{url: '{down}/score'}}}}"
    err = refused_before_start(capsys, write_grpo_config(reward=reward))
    assert err.startswith(f"reward.remote.url: the reward server at {down}/score failed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fresh_run_does_not_append_to_an_earlier_runs_metrics(write_grpo_config, capsys):
    config = write_grpo_config()
    metrics = config.parent / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 0, "eval/accuracy": 0.1}\n')
    err = refused_before_start(capsys, config)
    assert f"{metrics} (metrics.jsonl_path) already holds the metrics of an earlier run" in err
    assert metrics.read_text() == '{"step": 0, "eval/accuracy": 0.1}\n'


def test_eval_every_with_an_empty_eval_set(write_grpo_config, capsys):
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "dataset.toy_task.num_eval=0", "eval.every=2"]
    )
    assert "eval.every is 2 but the eval set is empty" in err


@pytest.mark.parametrize("override", ["generator.sampling.top_p=0.9", "generator.sampling.top_k=5"])
def test_filtered_sampling_in_training(write_grpo_config, capsys, override):
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), override])
    assert "biases the importance ratio" in err and "top_p 1.0 and top_k 0" in err


def test_existing_checkpoints_need_resume(write_grpo_config, tmp_path, capsys):
    complete = tmp_path / "run" / "checkpoints" / "step_00000004"
    complete.mkdir(parents=True)
    (complete / "run_state.pt").write_bytes(b"")
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config())])
    assert "already holds checkpoints (newest: step_00000004): pass resume=true" in err


def test_an_export_over_the_starting_model_is_refused(write_grpo_config, tiny_policy, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(tiny_policy, out / "export")
    before = sorted(p.name for p in (out / "export").iterdir())
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), f"policy_path={out / 'export'}", f"output_dir={out}"]
    )
    assert f"the run exports to {out / 'export'}, which would overwrite policy_path" in err
    assert sorted(p.name for p in (out / "export").iterdir()) == before


def test_a_misspelled_policy_path_does_not_retrain_the_warm_start(write_grpo_config, tmp_path, capsys):
    sft = tmp_path / "sft.yaml"
    sft.write_text(
        f"run_dir: {tmp_path / 'sft'}\nexport_dir: {tmp_path / 'sft' / 'export'}\nmax_steps: 1\n"
        "data: {embedded_task: {num_train: 8, num_eval: 2}}\n"
    )
    typo = tmp_path / "sft" / "exprt"
    err = run_expecting_exit(
        capsys,
        ["--config", str(write_grpo_config()), f"policy_path={typo}", f"warm_start.sft_config={sft}"],
    )
    assert (
        f"no model at {typo}, and the warm start ({sft}) exports a model to {tmp_path / 'sft' / 'export'}"
        in err
    )
    assert not (tmp_path / "sft").exists()  # nothing was trained


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"prompt": "1+1=", "target": "2"}\n{"prompt": "2+2=", "target": \n', "line 2: not a JSON object"),
        (
            b'{"prompt": "1+1=", "target": "2"}\n{"prompt": "\xff\xfe", "target": "4"}\n',
            "line 2: not UTF-8 text",
        ),
        (b'{"prompt": "1+1=", "target": "2"}\n[1, 2]\n', "line 2: a row is a JSON object, got list"),
    ],
)
def test_a_malformed_dataset_file_names_file_and_line(write_grpo_config, tmp_path, capsys, content, expected):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(content)
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "dataset.source=file", f"dataset.path={rows}"]
    )
    assert f"{rows}, {expected}" in err


def test_a_missing_dataset_file_is_not_looked_up_on_the_hub(write_grpo_config, capsys):
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "dataset.source=file", "dataset.path=data/nope.jsonl"]
    )
    assert "data/nope.jsonl: no such file or folder" in err and "hf://NAME" in err


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("max_steps=-5", "max_steps"),
        ("replay_buffer.batch_size=0", "replay_buffer.batch_size"),
        ("replay_buffer.max_policy_age=-1", "replay_buffer.max_policy_age"),
        ("eval.num_prompts=0", "eval.num_prompts"),
    ],
)
def test_out_of_range_numbers_are_refused_before_start_up(write_grpo_config, capsys, override, key):
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), override])
    assert key in err


def refused_before_start(capsys, config, *overrides: str) -> str:
    """The refusal's message, checked to be one line that comes before the run made anything:
    the run writes output_dir/config.yaml before it starts a process."""
    err = run_expecting_exit(capsys, ["--config", str(config), *overrides])
    message = err.split("error: ", 1)[1].rstrip("\n")  # after the `datasets` progress bars, if any
    assert "\n" not in message, err
    assert not (config.parent / "run" / "config.yaml").exists(), "the run started"
    return message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "reward.functions=[{name: toy_task, weight: nan}]",
            "reward.functions[0].weight: Input should be a finite number, got 'nan'",
        ),
        ("trainer.engine.optimizer.lr=inf", "trainer.engine.optimizer.lr: Input should be a finite number"),
        (
            "trainer.engine.optimizer.betas=[0.9,1.0]",
            "trainer.engine.optimizer.betas[1]: Input should be less than 1",
        ),
        ("trainer.loss.beta=nan", "beta: Input should be a finite number"),
        ("reward.error_reward=-inf", "reward.error_reward: Input should be a finite number"),
        ("reward.memory_limit_gib=0", "reward.memory_limit_gib: Input should be greater than 0"),
        ("trainer.procs=0", "trainer.procs: Input should be greater than or equal to 1"),
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
        (
            "generator.sampling.stop_token_ids=[-1]",
            "generator.sampling.stop_token_ids[0]: Input should be greater",
        ),
    ],
)
def test_non_finite_and_out_of_range_settings_are_refused(write_grpo_config, capsys, override, expected):
    assert expected in refused_before_start(capsys, write_grpo_config(), override)


def test_a_memory_limit_without_the_reward_worker_is_refused(write_grpo_config, capsys):
    message = refused_before_start(
        capsys, write_grpo_config(), "reward.timeout_s=null", "reward.memory_limit_gib=2"
    )
    assert "reward.memory_limit_gib is 2 and reward.timeout_s is null" in message
    assert "set a timeout_s, or memory_limit_gib: null" in message


@pytest.mark.parametrize(
    ("second_row", "column", "says"),
    [
        ('{"target": "4"}', "prompt", "the prompt is missing or null"),
        ('{"prompt": null, "target": "4"}', "prompt", "the prompt is missing or null"),
        ('{"prompt": "2+2="}', "target", "the target is missing or null"),
        ('{"prompt": "2+2=", "target": null}', "target", "the target is missing or null"),
    ],
)
def test_a_row_without_a_prompt_or_target_names_file_row_and_column(
    write_grpo_config, tmp_path, capsys, second_row, column, says
):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "target": "2"}\n' + second_row + "\n")
    err = refused_before_start(capsys, write_grpo_config(), "dataset.source=file", f"dataset.path={rows}")
    assert f"{rows}: row 2, column '{column}': {says}" in err


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["trainer.engine.model.vocab_size=128"], "trainer.engine.model.vocab_size is 128"),
        (["~trainer.engine.model.vocab_size"], "trainer.engine.model.flavor 'tiny' has vocab_size 128"),
    ],
)
def test_a_new_model_with_more_rows_than_tokens_is_refused(
    write_grpo_config, tiny_policy, capsys, overrides, named
):
    # No hf_path: the trainer's model is built from its flavor, with random embedding rows.
    err = refused_before_start(capsys, write_grpo_config(), "trainer.engine.model.hf_path=null", *overrides)
    tokens = len(embedded_tokenizer())
    assert f"{named} but the tokenizer at {tiny_policy} has {tokens} tokens" in err
    assert f"decode to nothing. Set trainer.engine.model.vocab_size={tokens}" in err


def test_an_output_dir_that_cannot_be_written_is_refused(write_grpo_config, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "run"
    err = refused_before_start(capsys, write_grpo_config(), f"output_dir={out}")
    assert f"output_dir: cannot write to {out} (Not a directory)" in err and "resume=true" in err
    if Path("/sys/kernel").is_dir():  # an existing folder that not even root can write to
        err = refused_before_start(capsys, write_grpo_config(), "output_dir=/sys/kernel")
        assert "output_dir: cannot write to /sys/kernel (Permission denied)" in err


def test_an_agent_function_that_cannot_be_used_is_refused_before_start(write_grpo_config, capsys):
    config = write_grpo_config()
    err = run_expecting_exit(capsys, ["--config", str(config), "agent.function=no_such_module:solve"])
    assert "agent.function: cannot import module 'no_such_module'" in err
    err = run_expecting_exit(capsys, ["--config", str(config), "agent.function=json:dumps"])
    assert "agent.function: 'json:dumps' must name an async function (client, model, row)" in err
    # An environment and an agent are two sources of episodes.
    env = write_grpo_config(env="{name: 'forge.envs.tool_env:ToolEnvironment'}")
    err = run_expecting_exit(capsys, ["--config", str(env), "agent.function=agent_programs:two_calls"])
    assert "are two sources of episodes: set one" in err


def test_a_teacher_or_critic_that_cannot_be_used_is_refused_before_start(
    write_grpo_config, tiny_policy, tmp_path, capsys
):
    """distill: a missing teacher_path key, a directory that does not exist, and a teacher whose
    tokenizer is not the policy's (named with both paths and what differs); a critic checkpoint
    (critic.path) likewise."""
    config = write_grpo_config()
    message = refused_before_start(capsys, config, "distill={weight: 0.5}")
    assert "missing required key 'distill.teacher_path'" in message
    missing = tmp_path / "no_teacher"
    message = refused_before_start(capsys, config, f"distill.teacher_path={missing}")
    assert f"distill.teacher_path: model directory '{missing}' does not exist" in message
    from transformers import AutoTokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_policy, teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(teacher)
    size = len(embedded_tokenizer())
    message = refused_before_start(capsys, config, f"distill.teacher_path={teacher}")
    assert f"the teacher's tokenizer ({teacher}) is not the policy's ({tiny_policy})" in message
    assert f"{size} vs {size + 1} tokens" in message
    assert f"'<teacher-only>': None vs {size}" in message
    # A critic's checkpoint (critic.path) reads the policy's token ids too.
    critic = ["rollout.advantage=gae", f"critic.path={teacher}"]
    message = refused_before_start(capsys, config, *critic)
    assert f"critic.path: the critic's tokenizer ({teacher}) is not the policy's ({tiny_policy})" in message
    message = refused_before_start(capsys, config, "rollout.advantage=gae", f"critic.path={missing}")
    assert f"critic.path: model directory '{missing}' does not exist" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["rollout.kl_coef=0.1"],
            "rollout.kl_coef (0.1) is a KL penalty in the token rewards, and rollout.advantage is grpo",
        ),
        (
            ["rollout.advantage=reinforce_pp", "rollout.kl_coef=0.1", "reference.enabled='off'"],
            "rollout.kl_coef (0.1) needs the reference model, and reference.enabled is off",
        ),
        (
            [
                "distill.teacher_path=${policy_path}",
                "reward.functions=[]",
                "rollout.skip_groups_without_signal=true",
            ],
            "rollout.skip_groups_without_signal=true drops every group of a run with no reward",
        ),
    ],
)
def test_token_advantage_settings_that_disagree_are_refused(write_grpo_config, capsys, overrides, expected):
    assert expected in refused_before_start(capsys, write_grpo_config(), *overrides)
