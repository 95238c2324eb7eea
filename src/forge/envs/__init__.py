"""Environments for multi-turn episodes and tool-using agents (rolled out by ``forge.rollout``).

- ``base``: the interface (``Environment``, ``EnvStep``) a user subclasses;
- ``turns``: the environment's turns as ids, in the chat template's formatting;
- ``sessions``: environment instances per trajectory (in-process; ``forge.actors.environment``
  puts them in an actor);
- ``sandbox``: the Linux-namespace sandbox that runs model-written code.
"""

from forge.envs.base import Environment, EnvStep

__all__ = ["EnvStep", "Environment"]
