"""Rollouts: dataset rows -> groups of scored trajectories, and the records of what was rolled out.

- `trajectories`: one trajectory's tokens as they grow, turn by turn;
- `groups`: groups of trajectories, token in and token out, with an environment (one turn per
  prompt without one) and either engine;
- `scores`: each trajectory's reward, summed from every source (functions, server, reward
  models, the environment), for the app's step and the serial recipe alike;
- `step`: one rollout step over actor handles: sample prompts, roll out, score, add to the
  replay buffer;
- `eval`: the greedy eval and its accuracy;
- `records`: the rollout records (one JSON object per episode and per eval answer).

Import the submodules directly.
"""
