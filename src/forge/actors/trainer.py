"""TitanTrainer: the policy's training step, weight publishing and checkpoints, as an actor.

`push_weights` copies the weights into a snapshot and returns; the store transfer runs in
the background on this actor's event loop while the next `train_step` computes in a worker
thread (forge.weight_sync.WeightPublisher).

With LoRA the trainer is also the KL term's reference model (`reference_logprobs`): the base
model is its own with the adapters off, so no second copy of the model is needed.
"""

from __future__ import annotations

import time

import torch
from monarch.actor import current_rank, endpoint
from torch.profiler import record_function

from forge.actors.engine_checkpoints import EngineCheckpoints
from forge.actors.reference import record_reference_pass
from forge.cuda_threads import to_thread_on
from forge.data.types import Completion
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.row_shards import gather_to_first_rank
from forge.engines.titan.shares import Share
from forge.observability import Reduce, record_metric
from forge.observability.step_profiler import StepProfiler
from forge.rl.batch import PolicyBatch
from forge.rl.losses import LossConfig, loss_from_config
from forge.weight_sync import WeightPublisher
from forge.weight_transports import build_transport


class TitanTrainer(EngineCheckpoints):
    """Runs on `procs` ranks (data parallel); every endpoint is called on all ranks."""

    def __init__(
        self,
        engine: TitanEngineConfig,
        loss: LossConfig,
        weights_dtype: str | None = None,
        keep_weight_versions: int = 2,
        weight_transport: str = "store",
        verify_weights: bool = False,
        profile_step: int | None = None,
        profile_dir: str | None = None,
    ):
        self.engine_config = engine
        self.loss_config = loss
        # The dtype the weights travel in: the generator's. None keeps the parameters' own.
        self.weights_dtype = weights_dtype
        self.keep_weight_versions = keep_weight_versions
        self.weight_transport = weight_transport
        self.verify_weights = verify_weights
        self.profile_step = profile_step
        self.profile_dir = profile_dir

    @endpoint
    async def setup(self) -> None:
        from forge.engines.titan.engine import TitanEngine

        self.engine = TitanEngine(self.engine_config, trainable=True)
        self.loss_fn = loss_from_config(self.loss_config)
        self.rank = current_rank().rank
        self.publisher = WeightPublisher(
            self.keep_weight_versions,
            build_transport(self.weight_transport, rank=self.rank),
            verify=self.verify_weights,
        )
        self.profiler = StepProfiler(self.profile_step, self.profile_dir, f"trainer_rank{self.rank}")

    @endpoint
    async def train_step(self, batches: list[PolicyBatch]) -> dict[str, float]:
        """One optimizer step; ``batches[r]`` is data-parallel rank r's share (the ranks of a
        tensor-parallel group read the same one)."""
        self.profiler.step_starts(self.engine.step + 1)
        batch = batches[self.engine.dp_rank]
        with record_function("forge.train_step"):
            if self.profiler.active:  # on the profiler's thread, so that its CPU work is recorded
                metrics = self.engine.train_step(batch, self.loss_fn)
            else:  # in a thread, so that a background weight publish progresses on the event loop
                metrics = await to_thread_on(self.engine.device, self.engine.train_step, batch, self.loss_fn)
        if self.rank == 0:
            for key, value in metrics.items():
                record_metric(key, value, Reduce.MEAN)
        return metrics

    @endpoint
    async def evaluate(self, batches: list[PolicyBatch]) -> dict[str, float]:
        """The loss and its metrics on this rank's share, without a gradient step."""
        batch = batches[self.engine.dp_rank]
        out = self.loss_fn(self.engine.forward(batch.tokens), batch.to(self.engine.device))
        return {
            "eval/loss": out.loss.item(),
            **{f"eval/{k.split('/', 1)[-1]}": v for k, v in out.metrics.items()},
        }

    @endpoint
    async def compute_logprobs(self, tokens, target_ids, temperature: float = 1.0):
        """`[B, T]` logprobs of `target_ids` under the current policy (no gradient)."""
        return self.engine.score_tokens(tokens, target_ids, torch.ones_like(target_ids), temperature).logprobs

    @endpoint
    async def reference_logprobs(self, completions: list[Completion]) -> Share:
        """With LoRA, the KL term's reference (what a `ReferenceModel` answers): this rank's
        data-parallel share of the completions' response-token logprobs under the base model,
        the policy with its adapters off, at the loss's temperature. Endpoints run one at a
        time, so no train step ever sees the adapters off; in a thread, as `train_step`, so
        that a background weight publish goes on meanwhile."""
        from forge.engines.titan.logprobs import share_logprobs

        def base_share() -> Share:
            with self.engine.adapters_disabled():
                return share_logprobs(self.engine, completions, self.loss_fn.temperature)

        started = time.perf_counter()
        share = await to_thread_on(self.engine.device, base_share)
        record_reference_pass(completions, time.perf_counter() - started)
        return share

    @endpoint
    async def push_weights(self, version: int) -> None:
        """Publishes the current weights (HF names) as `version`: returns once they are copied,
        the store transfer goes on in the background (`wait_published` waits for it). With LoRA
        only the adapters are published (`forge.engines.lora_sync`): generators hold the base."""
        with record_function("forge.push_weights"):
            await self._push_weights(version)

    async def _push_weights(self, version: int) -> None:
        started = time.perf_counter()
        if self.engine.adapters is not None:
            # In their own dtype, not the generator's: the generator's merge must round as the
            # trainer's does. Small enough to gather whole, on any transport.
            adapters = self.engine.hf_adapter_state_dict()  # a collective: every rank gathers
            if self.rank == 0:
                await self.publisher.publish(version, adapters)
        else:
            await self._push_model_weights(version)
        if self.rank == 0:
            record_metric("trainer/push_weights_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)

    async def _push_model_weights(self, version: int) -> None:
        dtype = getattr(torch, self.weights_dtype) if self.weights_dtype else None
        shards = self.engine.hf_row_shards(dtype) if self.publisher.publishes_rows else None
        if shards is not None:  # each rank its own rows, in its own slots: nothing gathered
            part = await self.publisher.stage_rows(version, shards.tensors, shards.first_rows)
            parts = gather_to_first_rank(part)  # a collective of small handles
            if self.rank == 0:
                await self.publisher.publish_parts(version, parts)
        else:
            state_dict = self.engine.hf_state_dict(dtype)  # a collective: every rank gathers
            if self.rank == 0:
                await self.publisher.publish(version, state_dict)

    @endpoint
    async def wait_published(self) -> None:
        """Until the last `push_weights` is in the store (raises if that failed)."""
        await self.publisher.wait()

    @endpoint
    async def export_hf(
        self, out_dir: str, tokenizer_dir: str | None = None, dtype: str | None = None
    ) -> str:
        """Writes a Hugging Face directory (every rank gathers, rank 0 writes); ``dtype`` None
        keeps the starting checkpoint's."""
        return str(self.engine.export_hf(out_dir, tokenizer_dir, dtype))

    @endpoint
    async def export_peft(self, out_dir: str) -> str:
        """Writes the LoRA adapters as a PEFT adapter directory for the checkpoint the trainer
        started from (every rank gathers, rank 0 writes)."""
        return str(self.engine.export_peft(out_dir))
