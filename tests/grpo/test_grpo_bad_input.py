"""Bad input to the GRPO app fails at start-up with a message naming what to fix."""

import pytest
from apps.grpo.main import main
from startup_errors import startup_error


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
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "trainer.loss.params.clip_lo=0.1"]
    )
    assert "clip_lo" in err


def test_unknown_reward_function(write_grpo_config, capsys):
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "reward.functions=[{name: exact_matc}]"]
    )
    assert "unknown reward function 'exact_matc'" in err


def test_temperature_mismatch(write_grpo_config, capsys):
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "generator.sampling.temperature=0.7"]
    )
    assert "must equal generator.sampling.temperature" in err


def test_unknown_eval_reward_function(write_grpo_config, capsys):
    err = run_expecting_exit(capsys, ["--config", str(write_grpo_config()), "eval.reward_fn=exact_mach"])
    assert "eval.reward_fn" in err and "unknown reward function 'exact_mach'" in err


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


def test_prompts_too_long_for_the_trainer(write_grpo_config, capsys):
    # The toy prompts are about 7 tokens: 8 - 4 + 1 leaves room for 5.
    err = run_expecting_exit(
        capsys, ["--config", str(write_grpo_config()), "trainer.engine.training.seq_len=8"]
    )
    assert "training prompts are longer than 5 tokens" in err and "trainer.engine.training.seq_len 8" in err


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
