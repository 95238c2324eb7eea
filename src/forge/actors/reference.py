"""ReferenceModel: forward-only logprobs of a frozen model: the initial policy (for the KL
term), or a teacher's checkpoint (on-policy distillation), each its own actor.

It runs with the trainer's parallelism: launched on as many processes and hosts as the trainer
(``trainer.procs``, ``trainer.hosts``), in the trainer's GPU group, each process building its
``TitanEngine`` from the trainer's engine config, so the model is sharded (FSDP) and split
(TP) exactly as the trainer's is, and any parallelism the trainer accepts, the reference
accepts. Every endpoint is called on all ranks. ``reference_logprobs`` gets every completion on
every rank; each data-parallel rank computes its share (the ranks of a TP group the same one, a
rank with fewer micro-batches idle passes to match, see ``forge.engines.titan.logprobs``), and
``reference_logprobs``, the caller's side, joins the shares back in the completions' order.

With LoRA (``trainer.engine.lora``) the reference is the base model, which the trainer holds
already: the trainer answers the same endpoint with its adapters off
(``TitanTrainer.reference_logprobs``), and no ReferenceModel runs.
"""

from __future__ import annotations

import time

from monarch.actor import current_rank, endpoint

from forge.controller import ForgeActor
from forge.data.types import Completion
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.shares import Share, join_shares
from forge.observability import Reduce, record_metric


class ReferenceModel(ForgeActor):
    def __init__(self, engine: TitanEngineConfig, temperature: float = 1.0, role: str = "reference"):
        """`role` names its metrics (`reference/...`, `teacher/...`)."""
        self.engine_config = engine
        self.temperature = temperature
        self.role = role

    @endpoint
    async def setup(self) -> None:
        from forge.engines.titan.engine import TitanEngine

        self.engine = TitanEngine(self.engine_config, trainable=False)

    @endpoint
    async def reference_logprobs(self, completions: list[Completion]) -> Share:
        """This rank's data-parallel share of the completions' response-token logprobs."""
        from forge.engines.titan.logprobs import share_logprobs

        started = time.perf_counter()
        share = share_logprobs(self.engine, completions, self.temperature)
        record_reference_pass(completions, time.perf_counter() - started, self.role)
        return share


def record_reference_pass(completions: list[Completion], seconds: float, role: str = "reference") -> None:
    """The metrics of one call of a frozen model in `role` (`reference/...`, `teacher/...`),
    which took `seconds` (rank 0 records them)."""
    if current_rank().rank == 0:
        tokens = sum(len(c.prompt_ids) + len(c.response_ids) - 1 for c in completions)
        record_metric(f"{role}/forward_s", seconds, Reduce.SUM)
        record_metric(f"{role}/tokens_per_s", tokens / seconds, Reduce.MEAN)


async def reference_logprobs(reference, completions: list[Completion]) -> list[list[float]]:
    """Per completion, the reference model's logprob of each response token given the tokens
    before it: one call that all of ``reference``'s ranks answer, each for its share
    (``reference``: a ReferenceModel, or with LoRA the trainer)."""
    return join_shares(await reference.reference_logprobs.route_per_rank(completions), len(completions))
