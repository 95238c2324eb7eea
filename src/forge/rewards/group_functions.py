"""Group reward functions: ``fn(prompts, responses, targets) -> list[float]`` scores a whole group
(the responses to one prompt) in one call, for rewards that compare responses with each other:
a judge that ranks them, a bonus for a response unlike the others.

A function says it scores groups with the `group_reward` decorator, next to its signature, so
that no config can call it the wrong way; configs name it like any reward function (a built-in
name or ``"package.module:function"``) and weigh it the same way. It gets one list entry per
response of the group: the prompts (equal, except after several turns, when each response has
its own conversation before it), the responses and the targets (the row's, repeated), and
returns one finite number per response, in order. Anything else (another length, a value that
is not a finite number, an exception, a hang) scores ``reward.error_reward`` for the whole group
and is counted as one error or timeout of the function (`forge.rewards.scorer`).
"""

from collections import Counter
from collections.abc import Callable

GroupRewardFn = Callable[[list[str], list[str], list[str]], list[float]]

# Set on the function itself: the reward worker imports functions by name and finds it there too.
_SCORES_GROUPS = "forge_scores_groups"


def group_reward(fn: GroupRewardFn) -> GroupRewardFn:
    """Marks `fn` as a group reward function: called once per group as
    ``fn(prompts, responses, targets)``, it returns one score per response."""
    setattr(fn, _SCORES_GROUPS, True)
    return fn


def is_group_reward(fn: Callable) -> bool:
    return getattr(fn, _SCORES_GROUPS, False) is True


@group_reward
def distinct_in_group(prompts: list[str], responses: list[str], targets: list[str]) -> list[float]:
    """A diversity bonus: 1/k for a response that k responses of its group share (whitespace
    aside), so 1.0 for a response unlike the others and 1/n when all n are the same."""
    keys = [" ".join(response.split()) for response in responses]
    copies = Counter(keys)
    return [1.0 / copies[key] for key in keys]
