"""The tool demo's configs end to end (their CPU runs as shipped configs): multi-turn SFT on tool
demonstrations, then GRPO where the model calls the calculator in an environment actor, in sync
mode against the serial recipe.

One SFT run and one GRPO run are shared by the checks: the SFT warm start is cut short (it calls
the tool but copies numbers badly), which is what makes the trajectories multi-turn and the
rewards differ within a group.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest
from apps.grpo.main import main as grpo_main
from apps.sft.main import main as sft_main
from run_checks import check_every_step

from forge import inspect
from forge.config import load_config
from forge.grpo.config import GRPOConfig
from forge.recipes.grpo_serial import grpo_serial
from forge.rollout.records import decode_ids, read_records

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# The shipped configs, made small: few problems, a small batch, and the app in sync mode (one
# rollout loop, max_policy_age 0), where it equals the serial recipe bit for bit.
SYNC = [
    "seed=3",
    "max_steps=3",
    "actor_threads=1",
    "rollout.threads=1",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "replay_buffer.batch_size=16",
    "replay_buffer.max_policy_age=0",
    "dataset.toy_task.num_train=200",
    "dataset.toy_task.num_eval=8",
    "eval.every=1",
    "eval.num_prompts=8",
    "metrics.rollouts_every=1",
]
COMPARED = (
    "train/loss",
    "loss/pg",
    "loss/ratio_mean",
    "train/grad_norm",
    "buffer/sampled_reward",
    "eval/accuracy",
)


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> Path:
    """configs/sft/tool_cpu.yaml, stopped at 150 of its 200 steps."""
    run_dir = tmp_path_factory.mktemp("sft_tool")
    with contextlib.redirect_stdout(io.StringIO()):
        sft_main(
            [
                "--config",
                str(CONFIGS / "sft" / "tool_cpu.yaml"),
                f"run_dir={run_dir}",
                "max_steps=150",
                "checkpoint.every=0",
                "eval_every=0",
            ]
        )
    return run_dir / "export"


@pytest.fixture(scope="module")
def agent_run(warm_start, tmp_path_factory) -> tuple[Path, list[str], dict]:
    out = tmp_path_factory.mktemp("grpo_tool")
    overrides = [*SYNC, f"policy_path={warm_start}", f"output_dir={out}"]
    history = grpo_main(["--config", str(CONFIGS / "grpo" / "tool_cpu.yaml"), *overrides])
    return out, overrides, history


def test_the_agent_run_equals_the_serial_recipe(agent_run):
    out, overrides, history = agent_run
    # The checks of every shipped config's run (tests/grpo/test_shipped_configs.py).
    rows = check_every_step(out, history, steps=3)
    # The trajectories were multi-turn: a call, the calculator's answer, then the model's answer.
    assert all(r["rollout/turns"] > 1.5 for r in rows[1:] if "rollout/turns" in r)
    serial = grpo_serial(load_config(GRPOConfig, CONFIGS / "grpo" / "tool_cpu.yaml", overrides))
    expected = [{"step": 0, "eval/accuracy": serial["eval_accuracy"][0][1]}, *serial["metrics"]]
    assert len({r["train/loss"] for r in expected[1:]}) == 3  # not a comparison of constants
    for want, got in zip(expected, rows, strict=True):
        for key in COMPARED if want["step"] else ("eval/accuracy",):
            assert got[key] == want[key], f"step {want['step']}: {key} {got[key]} != {want[key]} (serial)"


def test_records_and_inspect_show_each_turn_and_what_was_trained(agent_run, capsys):
    out, _, _ = agent_run
    records = [r for r in read_records(out / "rollouts.jsonl") if not r["eval"]]
    with_tool = [r for r in records if any(t["role"] == "tool" for t in r["turns"])]
    assert with_tool, "no trajectory called the calculator"
    for record in with_tool:
        mask = decode_ids(record["response_mask"])
        assert (
            len(mask)
            == len(decode_ids(record["response_ids"]))
            == sum(t["num_tokens"] for t in record["turns"])
        )
        # The mask is 1 exactly on the model's turns, turn by turn.
        expected = [int(t["role"] == "assistant") for t in record["turns"] for _ in range(t["num_tokens"])]
        assert mask == expected
        # The calculator answered the call the model wrote.
        call, result = record["turns"][0]["text"], record["turns"][1]["text"]
        expression = call.removeprefix("<calc>").removesuffix("</calc>")
        if re.fullmatch(r"\d+(\+\d+)*", expression):
            assert result == f"<result>{sum(int(x) for x in expression.split('+'))}</result>"
    inspect.main([str(out), "--turns", "--limit", "50"])
    shown = capsys.readouterr().out
    assert "      tool | <result>" in shown and "read only" in shown and "trained" in shown
