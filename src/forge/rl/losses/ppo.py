"""PPO-clip family: PPO, GRPO, DAPO and GSPO differ in the ratio they clip, the clip range, the KL
term and the aggregation, and share everything else."""

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from forge.rl.batch import PolicyBatch
from forge.rl.losses.base import PolicyLoss, PolicyLossConfig, TokenTerms, token_fraction
from forge.rl.losses.off_policy import OffPolicyConfig, behaviour_weight
from forge.rl.ops import AggMode, KLEstimator, RatioLevel, compute_kl, compute_ratio, ppo_clip_loss


class ClippedSurrogateConfig(OffPolicyConfig, PolicyLossConfig):
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="the ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0.0, description="the ratio is clipped above at 1 + clip_high")


class ClippedSurrogateLoss(PolicyLoss):
    """PPO's clipped surrogate on an importance ratio against the generator's logprobs, or, with
    an ``off_policy`` correction, against the proximal policy (see ``forge.rl.losses.off_policy``)."""

    config: ClippedSurrogateConfig
    ratio_level: ClassVar[RatioLevel] = "token"

    def _surrogate(
        self, logprobs: Tensor, advantages: Tensor, response: Tensor, batch: PolicyBatch
    ) -> TokenTerms:
        corrected = self.config.off_policy != "none"
        # The proximal policy is this forward's, detached: see off_policy's docstring for why
        # the behaviour weight below, not this ratio, carries the correction.
        old_logprobs = logprobs.detach() if corrected else batch.generator_logprobs
        ratio, _ = compute_ratio(logprobs, old_logprobs, response, self.ratio_level)
        loss, clipped_low, clipped_high = ppo_clip_loss(
            ratio, advantages, self.config.clip_low, self.config.clip_high
        )
        metrics = {
            "loss/clip_frac_low": token_fraction(clipped_low, batch),
            "loss/clip_frac_high": token_fraction(clipped_high, batch),
        }
        if corrected:
            weight, weight_metrics = behaviour_weight(self.config, logprobs, response, batch)
            loss = weight * loss
            metrics.update(weight_metrics)
        return TokenTerms(loss, ratio, response, metrics)


class PPOLossConfig(ClippedSurrogateConfig):
    name: Literal["ppo"] = "ppo"
    agg_type: AggMode = "token_mean"


class PPOLoss(ClippedSurrogateLoss):
    """PPO's policy loss (Schulman et al. 2017): the clipped surrogate on per-token advantages,
    ``loss = mean_t -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)`` over the step's
    response tokens, with no KL term (PPO for LLMs puts the KL to the reference in the token
    rewards: ``rollout.kl_coef``). It is GRPO's surrogate; what makes a run PPO is its advantages,
    GAE from a critic (``rollout.advantage: gae``), and this loss names that run's defaults."""

    config_class = PPOLossConfig

    def _token_terms(
        self, logprobs: Tensor, advantages: Tensor, response: Tensor, batch: PolicyBatch
    ) -> TokenTerms:
        return self._surrogate(logprobs, advantages, response, batch)


class GRPOLossConfig(ClippedSurrogateConfig):
    name: Literal["grpo"] = "grpo"
    beta: float = Field(0.0, ge=0.0, description="weight of the KL penalty to the reference policy")
    kl_estimator: KLEstimator = "k3"
    agg_type: AggMode = "fixed_horizon"


class GRPOLoss(ClippedSurrogateLoss):
    """GRPO: PPO-clip on group-relative advantages, plus a KL penalty to a reference policy.

    ``loss = agg_t[-min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A) + beta * KL_t]`` with
    ``r_t = pi(y_t) / pi_generator(y_t)``. PPO: Schulman et al. 2017; GRPO: DeepSeekMath, Shao et
    al. 2024; the default ``fixed_horizon`` aggregation is Dr. GRPO's (Liu et al. 2025).

    ``ref_logprobs`` is required when ``beta > 0``; when given with ``beta == 0`` the KL is only
    reported. ``loss/pg`` and ``loss/kl`` use the loss's aggregation, so
    ``loss = loss/pg + beta * loss/kl``.
    """

    config_class = GRPOLossConfig
    config: GRPOLossConfig

    def _token_terms(
        self, logprobs: Tensor, advantages: Tensor, response: Tensor, batch: PolicyBatch
    ) -> TokenTerms:
        terms = self._surrogate(logprobs, advantages, response, batch)
        beta, ref_logprobs = self.config.beta, batch.ref_logprobs
        if ref_logprobs is None:
            if beta > 0:
                raise ValueError(
                    f"GRPOLoss(beta={beta}) needs ref_logprobs (the reference model's logprobs); "
                    "pass them, or set beta=0 to train without the KL penalty"
                )
            return terms
        kl = compute_kl(logprobs, ref_logprobs, self.config.kl_estimator, loss_mask=response)
        with torch.no_grad():
            metrics = {
                **terms.metrics,
                "loss/pg": self._aggregate(terms.loss.detach(), response, batch),
                "loss/kl": self._aggregate(kl.detach(), response, batch),
            }
        loss = terms.loss + beta * kl if beta > 0 else terms.loss
        return terms._replace(loss=loss, metrics=metrics)


class DAPOLossConfig(ClippedSurrogateConfig):
    name: Literal["dapo"] = "dapo"
    clip_high: float = Field(0.28, ge=0.0, description="the ratio is clipped above at 1 + clip_high")
    agg_type: AggMode = "token_mean"


class DAPOLoss(ClippedSurrogateLoss):
    """DAPO: PPO-clip with a higher upper clip ("clip-higher"), token-mean aggregation and no KL.

    ``loss = sum_t -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A) / #tokens`` with
    ``clip_high > clip_low`` (Yu et al. 2025). Tokens whose generator logprob is not finite are
    dropped (they contribute zero) and counted in ``loss/nonfinite_generator_logprobs``.
    """

    config_class = DAPOLossConfig

    def _token_terms(
        self, logprobs: Tensor, advantages: Tensor, response: Tensor, batch: PolicyBatch
    ) -> TokenTerms:
        finite = torch.isfinite(batch.generator_logprobs)
        terms = self._surrogate(logprobs, advantages, response & finite, batch)
        terms.metrics["loss/nonfinite_generator_logprobs"] = (response & ~finite).sum().to(torch.float32)
        return terms


class GSPOLossConfig(ClippedSurrogateConfig):
    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0.0, lt=1.0, description="the ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(4e-4, ge=0.0, description="the ratio is clipped above at 1 + clip_high")
    agg_type: AggMode = "sequence_mean"


class GSPOLoss(ClippedSurrogateLoss):
    """GSPO: PPO-clip on a length-normalised sequence ratio instead of per-token ratios.

    ``s_i = exp(mean_t log(pi(y_it) / pi_generator(y_it)))``,
    ``loss = mean_i -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` (Zheng et al. 2025).
    """

    config_class = GSPOLossConfig
    ratio_level = "sequence"

    def _token_terms(
        self, logprobs: Tensor, advantages: Tensor, response: Tensor, batch: PolicyBatch
    ) -> TokenTerms:
        return self._surrogate(logprobs, advantages, response, batch)
