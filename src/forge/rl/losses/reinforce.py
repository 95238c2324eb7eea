"""REINFORCE with an optional truncated importance weight, and CISPO, which is the same estimator
with the weight truncated at ``1 + clip_high``."""

from typing import Literal

from pydantic import Field, PositiveFloat
from torch import Tensor

from forge.rl.batch import PolicyBatch
from forge.rl.losses.base import PolicyLoss, PolicyLossConfig, TokenTerms, token_fraction
from forge.rl.ops import AggMode, compute_ratio


class ReinforceLossConfig(PolicyLossConfig):
    name: Literal["reinforce"] = "reinforce"
    tis_cap: PositiveFloat | None = Field(None, description="truncate the importance weight at this value")


class ReinforceLoss(PolicyLoss):
    """REINFORCE, optionally corrected for the generator/trainer mismatch by a truncated IS weight.

    ``loss = agg_t[-sg(w_t) A_t log pi(y_t)]`` with ``w_t = 1``, or with ``tis_cap`` set
    ``w_t = min(pi(y_t) / pi_generator(y_t), tis_cap)`` (Williams 1992; truncated importance
    sampling, Ionides 2008). The weight carries no gradient, so every token keeps one. With one
    optimizer step per batch this weight is the truncated behaviour weight of
    ``forge.rl.losses.off_policy`` (``pi_prox / pi_generator``, ``pi_prox`` the trainer's detached).
    """

    config_class = ReinforceLossConfig

    def _weight_cap(self) -> float | None:
        return self.config.tis_cap

    def _token_terms(
        self, logprobs: Tensor, advantages: Tensor, response: Tensor, batch: PolicyBatch
    ) -> TokenTerms:
        ratio, _ = compute_ratio(logprobs, batch.generator_logprobs, response)
        cap = self._weight_cap()
        if cap is None:
            return TokenTerms(-advantages * logprobs, ratio, response, {})
        weight = ratio.detach().clamp(max=cap)
        metrics = {"loss/clip_frac_high": token_fraction(weight < ratio.detach(), batch)}
        return TokenTerms(-weight * advantages * logprobs, ratio, response, metrics)


class CISPOLossConfig(PolicyLossConfig):
    name: Literal["cispo"] = "cispo"
    clip_high: float = Field(0.28, ge=0.0, description="the IS weight is truncated at 1 + clip_high")
    agg_type: AggMode = "token_mean"


class CISPOLoss(ReinforceLoss):
    """CISPO: the clipped importance weight, detached, scales REINFORCE's ``A * log pi``.

    ``loss = sum_t -sg(min(r_t, 1 + clip_high)) A_t log pi(y_t) / #tokens`` with
    ``r_t = pi(y_t) / pi_generator(y_t)`` (MiniMax-M1, 2025). Unlike PPO-clip, a clipped token
    keeps its gradient; the paper bounds the weight only from above.
    """

    config_class = CISPOLossConfig

    def _weight_cap(self) -> float:
        return 1.0 + self.config.clip_high
