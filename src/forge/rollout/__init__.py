"""Rollouts: dataset rows -> groups of scored trajectories, and the records of what was rolled out.

- `trajectories`: one trajectory's tokens as they grow, turn by turn;
- `groups`: groups of trajectories, token in and token out, with an environment (one turn per
  prompt without one) and either engine;
- `step`: one rollout step over actor handles: sample prompts, roll out, score (with
  `forge.rewards.sources.RolloutScorer`), add to the replay buffer;
- `eval`: the greedy eval and its accuracy;
- `records`: the rollout records (one JSON object per episode and per eval answer).

Import the submodules directly.
"""
