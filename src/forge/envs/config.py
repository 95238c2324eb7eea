"""The `env` section of a GRPO config: which environment the rollouts talk to, and the limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from forge.config import ForgeConfigModel


class EnvConfig(ForgeConfigModel):
    # "package.module:Class", a subclass of forge.envs.Environment; `params` go to its __init__.
    name: str
    params: dict[str, Any] = {}
    # Model turns per trajectory; one still going after this many is truncated.
    max_turns: int = Field(4, ge=1)
    # Tokens of the whole trajectory (prompt and every turn); None: the trainer's seq_len.
    max_tokens: int | None = Field(None, ge=2)
    # What happens to a trajectory cut by max_turns or max_tokens: trained like the others, or
    # dropped from the batch after its group's advantages are computed (counted either way, in
    # rollout/truncated and rollout/truncated_dropped).
    on_truncation: Literal["train", "drop"] = "train"
    # Environment actors, run as a service: a replica that dies, or hangs past a call's
    # deadline, is replaced, and the trajectories it held fail (and are rerun, see retries).
    replicas: int = Field(1, ge=1)
    # Seconds each reset, step or close of one trajectory's environment may take; one past it
    # fails its trajectory (counted in rollout/env_timeouts).
    step_timeout_s: float = Field(180.0, gt=0)
    # Reruns, from reset, of a trajectory whose environment failed (raised, timed out, or was lost
    # with its replica), counted in rollout/env_retries; a trajectory that fails them all drops its
    # group (rollout/env_failures).
    retries: int = Field(1, ge=0)

    def limits(self, seq_len: int):
        from forge.rollout.groups import TrajectoryLimits

        return TrajectoryLimits(self.max_turns, self.max_tokens or seq_len, self.retries)
