"""The `reasoning_gym` reward: a response scored by the reasoning-gym task that generated its row.

The row's target (`forge.data.reasoning_gym_source`) names the task, its settings and the item's
index: the item is built again from them, and the task's own ``score_answer`` scores the answer,
the content of the response's last ``<answer>...</answer>`` block (reasoning-gym's
``extract_answer``; ``None`` without one, which tasks score 0). Scores are the task's, in [0, 1],
partial credit included. A task whose ``score_answer`` raises on a malformed answer (e.g.
``prime_factorization`` on text that is not numbers) scores ``reward.error_reward`` for it,
counted in ``reward/reasoning_gym/errors``.

This module imports reasoning-gym (about 2 s) when it is imported: `forge.rewards.functions` imports it
only for a config that names the reward, and the reward worker imports it once, before it forks
the processes that score.
"""

from __future__ import annotations

import functools
import json

from forge.data.reasoning_gym_source import INSTALL_HINT, decode_target

try:
    import reasoning_gym
    from reasoning_gym.utils import extract_answer
except ImportError as e:
    raise ImportError(INSTALL_HINT) from e


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str):
    return reasoning_gym.create_dataset(task, **json.loads(config_json))


# A group's responses share their item, and a batch is scored in one process: one build each
# (some tasks take most of a second an item).
@functools.lru_cache(maxsize=1024)
def _item(task: str, config_json: str, index: int) -> dict:
    return _dataset(task, config_json)[index]


def reasoning_gym_reward(prompt: str, response: str, target: str) -> float:
    row = decode_target(target)
    config_json = json.dumps(row["config"], sort_keys=True)
    dataset = _dataset(row["task"], config_json)
    entry = _item(row["task"], config_json, row["index"])
    if str(entry["answer"]) != row["answer"]:
        # The scoring process built another item than the one the prompt came from.
        raise ValueError(
            f"task {row['task']!r} item {row['index']} has answer {str(entry['answer'])[:100]!r} here, "
            f"{row['answer'][:100]!r} where its row was made: run every process with the same "
            "reasoning-gym version (and PYTHONHASHSEED)"
        )
    return float(dataset.score_answer(extract_answer(response), entry))
