"""Off-policy corrections of the PPO-clip family: the generator (the behaviour policy) is not
exactly the policy being trained.

Three policies meet in a train step. ``pi_behav`` sampled the tokens (the generator's logprobs
in the batch: another engine, maybe an older version). ``pi_theta`` is being trained.
``pi_prox``, the proximal policy, is the trainer's policy at train time, before this step's
update. With one optimizer step per batch, ``pi_prox`` equals ``pi_theta`` at the forward, so its
logprobs are the forward's own, detached: no second pass is needed. The mismatch ratio
``m = pi_prox / pi_behav`` (no gradient) measures engine mismatch plus staleness.

``off_policy``:

- ``none`` (default): PPO's ratio ``pi_theta / pi_behav`` is clipped directly, as before.
- ``tis``: truncated importance sampling. The clipped ratio is ``pi_theta / pi_prox`` and each
  token's term is weighted by ``min(m, tis_cap)`` (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training").
- ``icepop``: the clipped ratio is ``pi_theta / pi_prox``; a token is weighted by ``m`` while
  ``icepop_low <= m <= icepop_high`` and masked (weight 0) outside that band (IcePop, Ring-1T 2025).
- ``decoupled``: decoupled PPO (AReaL, Fu et al. 2025): ``m * min(r A, clip(r) A)`` with
  ``r = pi_theta / pi_prox``; tokens with ``m > behaviour_cap`` are masked, as AReaL does.

Why this is a real correction and not the "ratio against a detached copy of itself": with
``pi_prox = sg(pi_theta)`` the clipped ratio ``r`` is 1 in value (so the clip never acts within
a single step) while its gradient is ``grad log pi_theta``. Alone, that would drop every
off-policy correction. Here the correction is the behaviour weight ``m``, which is *not* 1:
it differs from 1 as soon as the generator's distribution differs from the trainer's, and the
gradient of a token is ``-w(m) A grad log pi_theta``. With several optimizer steps per batch
``pi_prox`` would be the logprobs of a pass before the first step, and the clip would act.
Masked tokens count in the normaliser (they contribute zero), as with any dropped token.

Metrics (fractions of the step's response tokens): ``loss/is_weight_mean`` (mean of the
behaviour weight), ``loss/is_truncated_frac`` (tis: tokens whose weight hit the cap) and
``loss/is_masked_frac`` (icepop, decoupled: tokens masked).
"""

from typing import Literal, Self

import torch
from pydantic import Field, PositiveFloat, model_validator
from torch import Tensor

from forge.rl.batch import PolicyBatch
from forge.rl.losses.base import BaseLossConfig, token_fraction, token_mean
from forge.rl.ops import compute_ratio

OffPolicyCorrection = Literal["none", "tis", "icepop", "decoupled"]

_PARAMS_OF = {
    "tis": {"tis_cap"},
    "icepop": {"icepop_low", "icepop_high"},
    "decoupled": {"behaviour_cap"},
}


class OffPolicyConfig(BaseLossConfig):
    off_policy: OffPolicyCorrection = "none"
    tis_cap: PositiveFloat = Field(2.0, description="tis: the behaviour weight is truncated at this value")
    icepop_low: PositiveFloat = Field(0.5, description="icepop: tokens with m below this are masked")
    icepop_high: PositiveFloat = Field(2.0, description="icepop: tokens with m above this are masked")
    behaviour_cap: PositiveFloat | None = Field(
        None, description="decoupled: tokens with m above this are masked (None: none)"
    )

    @model_validator(mode="after")
    def _params_match_the_correction(self) -> Self:
        # By value, not by which keys were given: a config written out in full (every default
        # spelled) reads back as the same config.
        fields = type(self).model_fields
        for correction, names in _PARAMS_OF.items():
            stray = sorted(name for name in names if getattr(self, name) != fields[name].default)
            if stray and self.off_policy != correction:
                raise ValueError(f"{', '.join(stray)} only applies to off_policy='{correction}'")
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"icepop_low ({self.icepop_low}) must be below icepop_high ({self.icepop_high})")
        return self


def behaviour_weight(
    config: OffPolicyConfig, logprobs: Tensor, response: Tensor, batch: PolicyBatch
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weight ``[B, T]`` (no gradient) of the configured correction, and its metrics.

    ``logprobs`` are the trainer's (the proximal policy's once detached); the weight is 1 on
    tokens outside ``response``.
    """
    with torch.no_grad():
        mismatch, _ = compute_ratio(logprobs.detach(), batch.generator_logprobs, response)
        metrics = {}
        if config.off_policy == "tis":
            truncated = mismatch > config.tis_cap
            weight = mismatch.clamp(max=config.tis_cap)
            metrics["loss/is_truncated_frac"] = token_fraction(truncated & response, batch)
        else:
            if config.off_policy == "icepop":
                masked = (mismatch < config.icepop_low) | (mismatch > config.icepop_high)
            elif config.behaviour_cap is not None:
                masked = mismatch > config.behaviour_cap
            else:
                masked = torch.zeros_like(response)
            weight = torch.where(masked, 0.0, mismatch)
            metrics["loss/is_masked_frac"] = token_fraction(masked & response, batch)
        metrics["loss/is_weight_mean"] = token_mean(torch.where(response, weight, 0.0), batch)
    return weight, metrics
