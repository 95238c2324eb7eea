"""``ValueEngine``: a value model (PPO's critic), in this process (no Monarch).

It is the policy's architecture with a scalar head in place of the LM head: the engine builds
the model as ``TitanEngine`` does (parallelism, mixed precision, optimizer, LR schedule, DCP
checkpoints), loads a checkpoint's transformer weights (its LM head is left out) and starts the
head at 0, so the first values are 0 and the first updates move the head alone. The value of
response token t is read at the position whose logits would predict it (``forge.rl.batch``'s
layout): the state before the token is sampled.

``values`` scores completions; ``train_step`` takes a ``PolicyBatch`` with ``values`` (the
critic's, when the episodes were scored) and ``returns`` (GAE's) and lowers PPO's clipped value
loss (``forge.rl.losses.value``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from forge.data.types import Completion
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.hf import read_safetensors_dir
from forge.engines.titan.shares import Share, share_of
from forge.rl.batch import PolicyBatch, pad_sequences, response_rows
from forge.rl.losses.value import ValueLoss

# The head's Hugging Face-side names: the LM head, which the value model does not have.
_LM_HEAD = "lm_head.weight"
_HEAD_NAMES = frozenset({"output.weight", "output.bias"})


class ValueEngine(TitanEngine):
    """A trainable value model; ``config`` is an engine config like the policy's (the head's
    learning rate is the optimizer's)."""

    def __init__(self, config: TitanEngineConfig) -> None:
        if config.lora is not None:
            raise ValueError("a value model trains every weight: build it without lora")
        if config.parallelism.tensor_parallel_degree > 1:
            raise ValueError(
                "a value model does not support parallelism.tensor_parallel_degree > 1: its one-row "
                "head cannot be split over tensor-parallel ranks"
            )
        super().__init__(config, trainable=True)

    def _build_model(self) -> nn.Module:
        # The head replaces the output layer, which tied embeddings would tie back to the
        # embedding (torchtitan re-ties them in init_weights).
        self.model_args.enable_weight_tying = False
        self.tied_embeddings = False
        model = super()._build_model()
        with torch.no_grad():
            for parameter in model.output.parameters():
                parameter.zero_()
        return model

    def _output_layer(self, linear: nn.Linear) -> nn.Module:
        return nn.Linear(linear.in_features, 1, bias=True, device="meta")

    def load_hf_checkpoint(self, path: str | Path) -> None:
        """The transformer's weights of a Hugging Face checkpoint (its LM head left out); the
        head keeps its zeros."""
        hf = {name: t for name, t in read_safetensors_dir(path).items() if name != _LM_HEAD}
        titan = {name: t for name, t in self.adapter.from_hf(hf).items() if name not in _HEAD_NAMES}
        missing, unexpected = set_model_state_dict(
            self.model, titan, options=StateDictOptions(full_state_dict=True, strict=False)
        )
        missing = sorted(name for name in missing if name.replace("._orig_mod", "") not in _HEAD_NAMES)
        if missing or unexpected:
            raise ValueError(
                f"the checkpoint {path} does not fit the value model: missing {missing}, unexpected "
                f"{sorted(unexpected)} (is it the policy's architecture?)"
            )

    @torch.no_grad()
    def token_values(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` float32 values of every position of ``tokens`` ``[B, T]``, in micro-batches of
        ``training.microbatch_size`` rows (all at once without); every data-parallel rank passes
        its own rows, as many passes as the rank with the most (each pass is a collective)."""
        size = self.config.training.microbatch_size or max(tokens.shape[0], 1)
        groups = list(torch.arange(tokens.shape[0]).split(size)) if tokens.shape[0] else []
        values = torch.zeros(tokens.shape)
        with self._compute_context():
            for rows in groups:
                values[rows] = self._logits(tokens[rows].to(self.device))[..., 0].float().cpu()
        for _ in range(self._max_over_data_parallel(len(groups)) - len(groups)):
            self._idle_pass(backward=False)
        return values

    def train_step(self, batch: PolicyBatch, loss_fn: ValueLoss, microbatch_size: int | None = None):
        """One optimizer step of the value loss on this rank's ``batch`` (``TitanEngine.train_step``)."""
        if batch.values is None or batch.returns is None:
            raise ValueError("a value model's train step needs batch.values and batch.returns")
        return super().train_step(batch, loss_fn, microbatch_size)


def completion_values(engine: ValueEngine, completions: Sequence[Completion]) -> list[list[float]]:
    """Per completion, the value of each response token (the state before it is sampled)."""
    tokens, _, span = pad_sequences(
        [c.prompt_ids for c in completions], [c.response_ids for c in completions], pad_id=0
    )
    return response_rows(engine.token_values(tokens), span)


def share_values(engine: ValueEngine, completions: Sequence[Completion]) -> Share:
    """``completion_values`` of this rank's data-parallel share of ``completions``; every rank of
    the engine's process group calls it with the same completions (``join_shares`` puts the
    shares back in order)."""
    share = share_of(completions, engine.dp_rank, engine.dp_size)
    if share:
        return Share(engine.dp_rank, engine.dp_size, completion_values(engine, share))
    # A rank with nothing to compute still runs the others' passes (each is a collective).
    engine.token_values(torch.zeros((0, 1), dtype=torch.long))
    return Share(engine.dp_rank, engine.dp_size, [])


def critic_metrics(step_metrics: dict[str, float]) -> dict[str, float]:
    """A value model's train-step metrics under ``critic/`` names: the loss's own, and the
    step's gradient norm, learning rate and whether it was skipped."""
    kept = {name: value for name, value in step_metrics.items() if name.startswith("critic/")}
    for name in ("grad_norm", "lr", "skipped"):
        kept[f"critic/{name}"] = step_metrics[f"train/{name}"]
    return kept
