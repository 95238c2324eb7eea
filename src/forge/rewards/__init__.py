"""Rewards: what scores a response, and how scoring survives the code that does it. No Monarch.

- `functions`: reward functions ``fn(prompt, response, target) -> float``, built in or named by
  import path, and the config type that checks a name; `group_functions`: functions that score
  a whole group per call; `math_verify_reward`, `reasoning_gym_reward`: built-ins whose
  libraries are imported only when a config names them.
- `scorer`: `RewardScorer`, the values of the functions and the reward server for each response,
  a `Failure` where a call failed (what the reward actor runs);
- `sources`: `RolloutScorer`, each trajectory's reward over typed sources: the functions, the
  reward models (classifiers, judges; a client per model, an actor service in the app, an engine
  in the serial recipe), the environment's step rewards, an agent's own reward; it weighs them,
  and applies and counts every source's failures in one place;
- `failures`: what a failed call scores (``reward.error_reward``) and how it is counted, for the
  functions, the reward server and the reward models alike.
- `worker`: the process that runs the functions with a time limit per call.
- `remote`: the reward server's client (``reward.remote``).
- `judge`: a generative judge's question and how its answer becomes a score.

Import the submodules directly: this package imports nothing, so that the reward worker
(``python -m forge.rewards.worker``) starts without loading what it does not need.
"""
