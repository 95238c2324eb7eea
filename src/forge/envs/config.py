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
    # Environment actors; more than 1 runs them as a service (a replica that dies is replaced,
    # and the groups it held are counted in rollout/groups_failed).
    replicas: int = Field(1, ge=1)

    def limits(self, seq_len: int):
        from forge.rollout.groups import TrajectoryLimits

        return TrajectoryLimits(self.max_turns, self.max_tokens or seq_len)
