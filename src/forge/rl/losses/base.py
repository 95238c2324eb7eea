"""What every loss shares: pydantic configs, the output type, and the call signature.

A loss is built from its config (``GRPOLoss(clip_low=0.1)``, ``GRPOLoss.from_config({...})``)
and called as ``loss_fn(logits, batch) -> LossOutput`` with a ``forge.rl.batch.PolicyBatch``
(on plain tensors: ``PolicyBatch(target_ids=..., loss_mask=..., advantages=...,
generator_logprobs=...)``). The call is pure tensor code, so ``torch.compile(loss_fn,
fullgraph=True)`` compiles it whole: metrics stay 0-d tensors until ``LossOutput.metrics`` is read.

Normalisation. Every denominator (token count, sequence count) comes from ``batch.loss_mask``,
or from ``batch.step_tokens`` / ``batch.step_sequences`` when the trainer sets them to the counts
of the whole optimizer step: then a loss and each of its metrics is this microbatch's share of
the step's value, and the trainer adds the shares over microbatches and data-parallel ranks
(``LossOutput.reductions`` names the metrics it takes the max of instead). Tokens a loss drops
or masks contribute zero but still count, so the normaliser never depends on the microbatching.
"""

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal, NamedTuple, Self

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    model_validator,
)
from torch import Tensor

from forge.rl.batch import PolicyBatch
from forge.rl.ops import (
    AggMode,
    aggregate,
    broadcast_advantages,
    check_logits,
    check_same_shape,
    compute_kl,
)
from forge.rl.token_scores import TokenScores, scores_from_logits

MetricReduce = Literal["sum", "max"]


class BaseLossConfig(BaseModel):
    """Parameters of a loss. Unknown keys fail at construction, so a typo never goes unnoticed,
    and so does NaN or infinity in a coefficient. Each loss's config has a ``name`` (its key in
    ``forge.rl.losses.LOSSES``), so that a config file's loss section is this config."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str  # each loss's config narrows it to its own name, with that as the default

    @model_validator(mode="before")
    @classmethod
    def _settings_beside_name(cls, data: Any) -> Any:
        # The loss section once held its settings in a `params` mapping.
        if isinstance(data, Mapping) and "params" in data:
            raise ValueError(
                "a loss takes its settings directly, beside `name`, not under `params`: write "
                "`loss: {name: grpo, beta: 0.1}` (override: trainer.loss.beta=0.1)"
            )
        return data


class AggregatedLossConfig(BaseLossConfig):
    agg_type: AggMode = "token_mean"
    horizon: PositiveInt | None = Field(
        None, description="fixed_horizon's constant length (the maximum response length); defaults to T"
    )

    @model_validator(mode="after")
    def _horizon_needs_fixed_horizon(self) -> Self:
        if self.horizon is not None and self.agg_type != "fixed_horizon":
            raise ValueError(f"horizon={self.horizon} only applies to agg_type='fixed_horizon'")
        return self


class PolicyLossConfig(AggregatedLossConfig):
    temperature: PositiveFloat = Field(1.0, description="the generator's sampling temperature")
    entropy_coef: NonNegativeFloat = Field(
        0.0,
        description="entropy bonus: the loss subtracts entropy_coef times the mean entropy of the "
        "policy over the step's response tokens (0: none)",
    )


@dataclass(frozen=True)
class LossOutput:
    """A scalar ``loss`` to backpropagate and its metrics.

    ``metric_tensors`` holds 0-d tensors (detached), so that computing them needs no graph break
    and no device sync; ``metrics`` converts them to floats with one sync, on first access.
    """

    loss: Tensor
    metric_tensors: dict[str, Tensor]
    reductions: Mapping[str, MetricReduce] = field(default_factory=dict)
    """How a trainer combines a metric over microbatches and ranks: ``"sum"`` (the default, right
    for shares of a step's value and for counts) or ``"max"``."""

    @functools.cached_property
    def metrics(self) -> dict[str, float]:
        if not self.metric_tensors:
            return {}
        values = torch.stack([t.detach().to(torch.float64) for t in self.metric_tensors.values()])
        return dict(zip(self.metric_tensors, values.tolist(), strict=True))


class Loss(ABC):
    """Base of every loss: holds the validated config, built from keyword arguments or a mapping."""

    config_class: ClassVar[type[BaseLossConfig]]

    def __init__(self, **params: Any) -> None:
        self.config = self.config_class(**params)
        # The temperature the model's logprobs are taken at (the generator's sampling temperature).
        self.temperature: float = getattr(self.config, "temperature", 1.0)
        # Whether the loss differentiates the entropy (an entropy bonus): the trainer then
        # computes the token scores with the entropy's gradient.
        self.entropy_grad: bool = getattr(self.config, "entropy_coef", 0.0) > 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | BaseLossConfig) -> Self:
        params = config.model_dump(exclude_unset=True) if isinstance(config, BaseLossConfig) else dict(config)
        return cls(**params)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config.model_dump(exclude={"name"}).items())
        return f"{type(self).__name__}({params})"

    def __call__(self, logits: Tensor, batch: PolicyBatch) -> LossOutput:
        where = type(self).__name__
        check_logits(where, logits, batch.target_ids)
        check_same_shape(where, target_ids=batch.target_ids, loss_mask=batch.loss_mask)
        return self.from_scores(
            scores_from_logits(logits, batch.scored_target_ids(), self.temperature, self.entropy_grad), batch
        )

    @abstractmethod
    def from_scores(self, scores: TokenScores, batch: PolicyBatch) -> LossOutput:
        """The loss from the model's per-token scores of ``batch.target_ids`` (``[B, T]`` each);
        the trainer computes them from hidden states without the full logits."""


def token_fraction(flags: Tensor, batch: PolicyBatch) -> Tensor:
    """Share of the step's response tokens where the boolean ``flags`` hold (see the module doc);
    float64, so that the shares of many microbatches add up exactly."""
    return aggregate(flags.to(torch.float64), batch.loss_mask, "token_mean", step_tokens=batch.step_tokens)


def token_mean(values: Tensor, batch: PolicyBatch) -> Tensor:
    return aggregate(values, batch.loss_mask, "token_mean", step_tokens=batch.step_tokens)


class TokenTerms(NamedTuple):
    """What a policy loss computes per token, before the shared aggregation and metrics."""

    loss: Tensor  # [B, T], reduced with the config's agg_type
    ratio: Tensor  # [B, T] importance ratio the loss used, for the ratio metrics
    response: Tensor  # [B, T] bool, the tokens that count (a loss may drop some)
    metrics: dict[str, Tensor]


class PolicyLoss(Loss):
    """A policy-gradient loss on the generator's samples; subclasses define ``_token_terms``.

    Metrics of every policy loss: ``loss/pg`` (the policy-gradient term), ``loss/ratio_mean`` and
    ``loss/ratio_max`` (the ratio the loss used, over response tokens), ``loss/mismatch_kl`` (k3
    estimate of KL(generator || trainer) on the generator's samples: engine mismatch plus
    staleness) and ``loss/entropy``. Losses that clip add ``loss/clip_frac_low`` /
    ``loss/clip_frac_high``: the fraction of response tokens whose gradient the clip removed, or
    whose importance weight it truncated.
    """

    config: PolicyLossConfig

    def from_scores(self, scores: TokenScores, batch: PolicyBatch) -> LossOutput:
        out = self.loss_from_logprobs(scores.logprobs, batch)
        entropy = token_mean(scores.entropy, batch)
        out.metric_tensors["loss/entropy"] = entropy.detach()
        if not self.config.entropy_coef:
            return out
        # A bonus: higher entropy lowers the loss, which keeps the policy from collapsing early.
        return replace(out, loss=out.loss - self.config.entropy_coef * entropy)

    def loss_from_logprobs(self, logprobs: Tensor, batch: PolicyBatch) -> LossOutput:
        """The same loss from the trainer's logprobs ``[B, T]`` (no entropy metric without logits);
        ``batch.target_ids`` is not read."""
        where = type(self).__name__
        for name in ("advantages", "generator_logprobs"):
            if getattr(batch, name) is None:
                raise ValueError(f"{where} needs batch.{name}")
        generator_logprobs, ref_logprobs = batch.generator_logprobs, batch.ref_logprobs
        response = batch.loss_mask != 0
        shapes = {"logprobs": logprobs, "generator_logprobs": generator_logprobs, "loss_mask": response}
        if ref_logprobs is not None:
            shapes["ref_logprobs"] = ref_logprobs
        check_same_shape(where, **shapes)
        # Zeroed where masked, so that a NaN advantage on padding cannot reach a gradient.
        advantages = torch.where(response, broadcast_advantages(batch.advantages, logprobs.shape), 0.0)
        terms = self._token_terms(logprobs, advantages, response, batch)
        loss = self._aggregate(terms.loss, terms.response, batch)
        with torch.no_grad():
            # The tokens were sampled from the generator, so it plays pi and the trainer ref.
            mismatch = compute_kl(generator_logprobs, logprobs.detach(), "k3", loss_mask=terms.response)
            ratio = torch.where(terms.response, terms.ratio.detach(), 0.0)
            metrics = {
                "loss/pg": loss.detach(),
                **terms.metrics,
                "loss/ratio_mean": token_mean(ratio, batch),
                "loss/ratio_max": ratio.max(),
                "loss/mismatch_kl": token_mean(mismatch, batch),
            }
        return LossOutput(loss, metrics, {"loss/ratio_max": "max"})

    @abstractmethod
    def _token_terms(
        self, logprobs: Tensor, advantages: Tensor, response: Tensor, batch: PolicyBatch
    ) -> TokenTerms:
        """Per-token terms from the trainer's ``logprobs``, the masked ``advantages`` ``[B, T]``,
        the ``response`` tokens (bool) and the batch's other fields."""

    def _aggregate(self, values: Tensor, kept: Tensor, batch: PolicyBatch) -> Tensor:
        """``values`` on the ``kept`` tokens, reduced with the config's aggregation."""
        return aggregate(
            torch.where(kept, values, 0.0),
            batch.loss_mask,
            self.config.agg_type,
            self.config.horizon,
            batch.step_tokens,
            batch.step_sequences,
        )
