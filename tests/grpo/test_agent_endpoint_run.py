"""The GRPO app with an agent program (`agent.function`) in sync mode: its episodes are trained
exactly as sampled, two runs give the same metrics, and agents that raise, hang, never call the
model or return no number fail only their own episodes, counted.

Two runs of the app are shared by the checks.
"""

import json

import pytest
from agent_programs import RESULT, reward_of
from apps.grpo.main import main

from forge import inspect
from forge.data.tokenizer import embedded_tokenizer
from forge.rollout.records import decode_ids, read_records

pytestmark = pytest.mark.slow

SYNC = [
    "agent.function=agent_programs:misbehaving",
    # Long enough that a working episode never times out on a loaded 2-core machine (1 s did),
    # short enough that the hanging rows cost little: each rollout waits this long for them.
    "agent.timeout_s=4",
    "max_steps=2",
    "seed=5",
    "replay_buffer.max_policy_age=0",
    "rollout.threads=1",
    "rollout.prompts_per_step=6",
    "replay_buffer.batch_size=8",
    "eval.every=0",
    "metrics.rollouts_every=1",
    "trainer.loss.beta=0.0",
]
# (rollout/reward is not among them: a rollout lands in the row of whichever flush collects it.)
COMPARED = ("train/loss", "loss/pg", "loss/ratio_mean", "train/grad_norm", "buffer/sampled_reward")


@pytest.fixture(scope="module")
def runs(grpo_config_factory):
    outs = []
    for _ in range(2):
        config = grpo_config_factory()
        main(["--config", str(config), *SYNC])
        outs.append(config.parent / "run")
    return outs


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_agent_runs_in_sync_mode_give_the_same_metrics(runs):
    first, second = (metrics(out) for out in runs)
    assert [r["step"] for r in first] == [1, 2]
    for a, b in zip(first, second, strict=True):
        for key in COMPARED:
            assert a[key] == b[key], f"step {a['step']}: {key} {a[key]} != {b[key]}"
    # Not a comparison of constants: the rewards differed within groups, so the policy moved.
    assert first[0]["train/grad_norm"] > 0 and first[0]["train/grad_norm"] != first[1]["train/grad_norm"]


def test_failing_agents_fail_their_episodes_only_and_are_counted(runs):
    rows = metrics(runs[0])
    total = {
        key: sum(r.get(f"agent/failures/{key}", 0) for r in rows)
        for key in ("errors", "timeouts", "no_calls")
    }
    # Of each rollout's 6 rows x 4 episodes: rows 0 and 3 mod 6 are errors (a raise, a string),
    # row 1 a timeout, row 2 no call; the run trained on the rest.
    assert total["errors"] > 0 and total["timeouts"] > 0 and total["no_calls"] > 0, total
    assert total["errors"] == 2 * total["timeouts"] == 2 * total["no_calls"], total
    assert all(r["train/loss"] == r["train/loss"] for r in rows)


def test_records_hold_the_calls_as_sampled_with_the_tool_message_read_only(runs, capsys):
    tokenizer = embedded_tokenizer()
    records = [r for r in read_records(runs[0] / "rollouts.jsonl") if not r["eval"]]
    assert records
    result_ids = tokenizer.encode(RESULT, add_special_tokens=False)
    for record in records:
        assert [t["role"] for t in record["turns"]] == ["assistant", "tool", "assistant"]
        # What the agent returned is the episode's reward, and nothing else scored it.
        assert record["reward_breakdown"] == {"agent": reward_of(record["turns"][-1]["text"])}
        assert record["reward"] == reward_of(record["turns"][-1]["text"])
        ids, mask = decode_ids(record["response_ids"]), decode_ids(record["response_mask"])
        first, tool, _ = (t["num_tokens"] for t in record["turns"])
        # The tool message as the template renders it after the model's turn: eos (unless
        # sampled) then its content, never trained.
        inserted = ids[first : first + tool]
        assert inserted[-len(result_ids) :] == result_ids and mask[first : first + tool] == [0] * tool
        assert mask[:first] == [1] * first and mask[first + tool :] == [1] * (len(ids) - first - tool)
    # forge.inspect shows the episode call by call, with what was trained.
    inspect.main([str(runs[0]), "--turns", "--limit", "3"])
    shown = capsys.readouterr().out
    assert f"      tool | {RESULT}" in shown and "read only" in shown and "trained" in shown
