"""``TitanEngine``: a TorchTitan model, its optimizer and checkpoints, in this process (no Monarch).

One engine serves the SFT trainer, the GRPO trainer and (with ``trainable=False``) the
reference model. It is built from the train spec the way torchtitan's own trainer builds
itself, since torchtitan 0.2.2's ``ForgeEngine`` does not import.

Every rank of a data/tensor-parallel group constructs an engine and calls the same methods in
the same order (they contain collectives); each rank passes its own share of the batch.
"""

import contextlib
import copy
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import utils as dist_utils
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.utils import set_default_dtype

from forge.engines.titan.attention import rows_metadata, use_document_attention
from forge.engines.titan.checkpoint import TrainState, load_dcp, save_dcp
from forge.engines.titan.checkpoint_model import check_config_agrees, read_checkpoint_model
from forge.engines.titan.compute_weights import ComputeWeights
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.decoder import TRAIN_SPEC_NAME
from forge.engines.titan.flavors import resolve_model_args
from forge.engines.titan.hf import (
    check_hf_state_dict,
    checkpoint_export_config,
    expected_hf_shapes,
    hf_config,
    read_safetensors_dir,
    write_hf_dir,
)
from forge.engines.titan.job_config import build_job_config
from forge.engines.titan.lora import AdapterWeights, LoraAdapters, is_adapter
from forge.engines.titan.lora_export import hf_adapter_tensors, write_peft_dir
from forge.engines.titan.packing import MicrobatchPlan, PackedRow
from forge.engines.titan.parallelize import build_parallel_dims, parallelize
from forge.engines.titan.row_shards import RowShards, hf_names, row_shards
from forge.engines.titan.runtime import init_runtime
from forge.engines.titan.scoring_head import ScoringHead
from forge.engines.titan.throughput import ModelFlops, PhaseTimer, peak_flops, step_throughput
from forge.rl.batch import PolicyBatch
from forge.rl.losses.base import Loss
from forge.rl.token_scores import TokenScores, scores_from_logits

logger = logging.getLogger(__name__)


class LossOutput(Protocol):
    loss: torch.Tensor
    """Scalar to minimize: this microbatch's share of the step's loss (normalised by the batch's
    ``step_tokens`` / ``step_sequences``, see ``forge.rl.losses.base``)."""
    metrics: Mapping[str, float | torch.Tensor]
    """Scalars to report, e.g. ``{"loss/kl": ...}``: shares of the step's value, summed over
    microbatches and ranks, unless ``reductions`` names them ``"max"``."""
    reductions: Mapping[str, str]


LossFn = Callable[[torch.Tensor, PolicyBatch], LossOutput]


class TitanEngine:
    """A model built from the train spec; with ``trainable=True`` also its optimizer and LR schedule.

    ``forward`` and ``train_step`` give logits ``[B, T, V]`` in the compute dtype: float32 by
    default, bfloat16 when ``training.dtype`` or ``training.mixed_precision_param`` is bfloat16
    (losses should upcast before a log-softmax).

    With ``lora`` set (and ``trainable``) the model's linear layers get LoRA adapters
    (``forge.engines.titan.lora``): only they are trained, and whatever reads the weights
    (``hf_state_dict``, ``hf_row_shards``, ``export_hf``) gets them merged into the base weights;
    ``hf_adapter_state_dict`` gives them alone (what weight publishing sends).
    """

    def __init__(self, config: TitanEngineConfig, trainable: bool = True) -> None:
        self.config = config
        self.trainable = trainable
        self.device = init_runtime()
        self.job_config = build_job_config(config)
        self.parallel_dims = build_parallel_dims(config.parallelism)
        # A checkpoint decides its model (config.json); without one, the named flavor does.
        self.checkpoint_model = None
        if config.model.hf_path is not None:
            self.checkpoint_model = read_checkpoint_model(config.model.hf_path)
            check_config_agrees(config.model, self.checkpoint_model, "model")
            self.spec = get_train_spec(TRAIN_SPEC_NAME)
            self.model_args = copy.deepcopy(self.checkpoint_model.model_args)
        else:
            self.spec = get_train_spec(config.model.name)
            self.model_args = resolve_model_args(
                config.model.name, config.model.flavor, config.model.vocab_size
            )
        # A flavor's export declares the flavor's context length; the engine itself only needs seq_len.
        self._context_length = max(self.model_args.max_seq_len, config.training.seq_len)
        self.model_args.update_from_config(self.job_config)
        self.adapter = self.spec.state_dict_adapter(self.model_args, None)
        self.tied_embeddings = getattr(self.model_args, "enable_weight_tying", False)
        # Each rank's loss is its share of the step's loss, so the step's gradient is the sum
        # over ranks. torchtitan disables FSDP's gradient averaging, so FSDP sums; DDP alone
        # averages, which this factor undoes.
        self._grad_scale = 1 if self.parallel_dims.fsdp_enabled else self.dp_size
        self.step = 0

        dist_utils.set_determinism(
            self.parallel_dims, self.device, self.job_config.debug, distinct_seed_mesh_dims=["pp"]
        )
        # Set by _build_model with `lora`: the adapted layers.
        self.adapters: LoraAdapters | None = None
        self.model = self._build_model()
        if config.model.hf_path is not None:
            self.load_hf_checkpoint(config.model.hf_path)
        self.optimizers = self.lr_schedulers = None
        if trainable:
            self.optimizers = self.spec.build_optimizers_fn(
                [self.model], self.job_config.optimizer, self.parallel_dims
            )
            self.lr_schedulers = self.spec.build_lr_schedulers_fn(
                self.optimizers, self.job_config.lr_scheduler, self.job_config.training.steps
            )
        else:
            self.model.eval()
            self.model.requires_grad_(False)
        logger.info(
            "built %s on %s (%d parameters, %d of them trained)",
            self.model_description,
            self.device,
            sum(p.numel() for p in self.model.parameters()),
            sum(p.numel() for p in self.model.parameters() if p.requires_grad),
        )

    @property
    def model_description(self) -> str:
        if self.checkpoint_model is not None:
            return f"{self.checkpoint_model.architecture} from {self.checkpoint_model.path}"
        return f"{self.config.model.name}/{self.config.model.flavor}"

    def _build_model(self) -> torch.nn.Module:
        # Every micro-batch, padded or packed, describes its sequences to the attention the same
        # way (forge.engines.titan.attention), through torchtitan's varlen code path.
        self.model_args.attn_type = "varlen"
        with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[self.config.training.dtype]):
            model = self.spec.model_cls(self.model_args)
        use_document_attention(model)
        model.output = self._output_layer(model.output)
        if self.config.lora is not None and self.trainable:
            frozen_dtype = TORCH_DTYPE_MAP[self.config.training.frozen_dtype]
            self.adapters = LoraAdapters.add_to(model, self.adapter, self.config.lora, frozen_dtype)
        args = self.model_args
        head_dim = getattr(args, "head_dim", None) or args.dim // args.n_heads
        self.flops = ModelFlops(model, args.n_layers, args.n_heads, head_dim)
        model = parallelize(model, self.spec, self.parallel_dims, self.job_config)
        self._head = model.output
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        if self.adapters is not None:  # init_weights leaves them as to_empty did: unset
            set_model_state_dict(
                model,
                self.adapters.initial(self.config.training.seed),
                options=StateDictOptions(full_state_dict=True, strict=False),
            )
        model.train()
        return model

    def _output_layer(self, linear: torch.nn.Linear) -> torch.nn.Module:
        """What replaces the model's output layer (on the meta device, before parallelizing): the
        scoring head on the same weight; a value model puts its scalar head there instead
        (``forge.engines.titan.value``)."""
        head = ScoringHead.replacing(linear)
        head.scored_rows = self.config.model.sampled_rows
        return head

    def _compute_context(self) -> contextlib.AbstractContextManager:
        """Around every pass of a step or scoring call, backward passes included (activation
        checkpointing recomputes the forward in them). FSDP applies mixed precision itself;
        without it, the weights are cast to the compute dtype once, on entry."""
        training = self.config.training
        if (
            training.dtype == "float32"
            and training.mixed_precision_param == "bfloat16"
            and not (self.parallel_dims.fsdp_enabled or self.parallel_dims.tp_enabled)
        ):
            return ComputeWeights(self.model, torch.bfloat16).installed()
        return contextlib.nullcontext()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` for ``tokens`` ``[B, T]``, without an autograd graph."""
        with self._compute_context():
            return self._logits(tokens.to(self.device))

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        # Tensor parallelism comes with sequence parallelism, which splits the sequence evenly
        # over the TP ranks (torchtitan pads every batch to training.seq_len for it): pad on
        # the right to its divisor and cut the logits back. Causal attention: padding after a
        # position changes nothing at it.
        width = tokens.shape[1]
        missing = -width % self.parallel_dims.seq_len_divisor if self.parallel_dims.tp_enabled else 0
        if missing:
            tokens = torch.nn.functional.pad(tokens, (0, missing))
        return self.model(tokens, attention_masks=rows_metadata(*tokens.shape, tokens.device))[:, :width]

    def _sampled_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits of the rows the generator samples (``model.sampled_rows``), which the losses
        and token scores read; the head does the same when it scores."""
        return self._logits(tokens)[..., : self.config.model.sampled_rows]

    @property
    def scores_in_head(self) -> bool:
        """Whether the output layer computes the losses' token scores itself (no logits). Not
        under tensor parallelism: its weight is split over the vocabulary there, and the losses
        score the gathered logits."""
        return not self.parallel_dims.tp_enabled

    def _scores(
        self,
        microbatch: PolicyBatch,
        packed: PackedRow | None,
        temperature: float,
        entropy_grad: bool = False,
    ) -> TokenScores:
        """The token scores of a micro-batch on the device, through the scoring head."""
        if packed is None:
            tokens, target_ids = microbatch.tokens, microbatch.scored_target_ids()
            attention, positions = rows_metadata(*tokens.shape, tokens.device), None
        else:
            tokens, target_ids, attention, positions = (
                packed.tokens,
                packed.target_ids,
                packed.attention,
                packed.positions,
            )
        with self._head.scoring(target_ids, temperature, entropy_grad):
            stacked = self.model(tokens, attention_masks=attention, positions=positions)
        return TokenScores.unstack(stacked if packed is None else packed.to_padded(stacked))

    def _plan(
        self, batch: PolicyBatch, packing: bool, microbatch_size: int | None
    ) -> tuple[MicrobatchPlan, int]:
        """The micro-batches of this rank's ``batch``, and the idle passes to run after them: under
        data parallelism every rank runs as many forward passes as the rank with the most (each
        pass is a collective)."""
        plan = MicrobatchPlan(
            batch,
            packing,
            microbatch_size or self.config.training.microbatch_size,
            self.config.training.microbatch_tokens,
        )
        return plan, self._max_over_data_parallel(len(plan)) - len(plan)

    def _max_over_data_parallel(self, value: int) -> int:
        if not self.parallel_dims.dp_enabled:
            return value
        tensor = torch.tensor(value, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.parallel_dims.get_mesh("batch").get_group())
        return int(tensor)

    def _idle_pass(self, backward: bool) -> None:
        """A forward (and backward) on one token that changes no gradient: the collectives of a
        pass for a rank that has no micro-batch left while others do."""
        token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with self._compute_context():
            out = self._logits(token)
        if backward:
            (out.sum() * 0).backward()

    @torch.no_grad()
    def score_tokens(
        self,
        tokens: torch.Tensor,
        target_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float = 1.0,
    ) -> TokenScores:
        """Scores ``[B, T]`` of ``target_ids`` where ``loss_mask`` is set (0 elsewhere) under
        ``softmax(logits / temperature)``, without a graph: packed by ``training.packing`` and
        ``microbatch_tokens`` (or all rows at once) as a train step would, on every rank of a
        data-parallel group (each with its own rows, possibly none)."""
        batch = PolicyBatch(target_ids=target_ids, loss_mask=loss_mask, tokens=tokens)
        fields = [field.name for field in dataclasses.fields(TokenScores)]
        if self.scores_in_head:
            scores = TokenScores(
                torch.zeros(target_ids.shape),
                torch.zeros(target_ids.shape),
                torch.zeros(target_ids.shape, dtype=torch.bool),
            )
            plan, idle_passes = self._plan(batch, self.config.training.packing, None)
            with self._compute_context():
                for microbatch in plan.on(self.device):
                    part = self._scores(microbatch.batch, microbatch.packed, temperature)
                    for name in fields:
                        getattr(scores, name)[microbatch.rows] = getattr(part, name).cpu()
            for _ in range(idle_passes):
                self._idle_pass(backward=False)
        else:
            with self._compute_context():
                logits = self._sampled_logits(tokens.to(self.device))
            scores = scores_from_logits(logits, batch.scored_target_ids().to(self.device), temperature)
        unscored = loss_mask == 0
        return TokenScores(*(getattr(scores, name).cpu().masked_fill(unscored, 0) for name in fields))

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (the ranks of a TP group share it)."""
        if not self.parallel_dims.dp_enabled:
            return 0
        return self.parallel_dims.get_mesh("batch").get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard

    def train_step(
        self, batch: PolicyBatch, loss_fn: LossFn, microbatch_size: int | None = None
    ) -> dict[str, float]:
        """One optimizer step on this rank's ``batch``.

        ``batch.tokens`` ``[B, T]`` is the model input. The batch is split into microbatches whose
        gradients accumulate. A forge ``Loss`` is computed from token scores that the output
        layer computes without logits (``forge.rl.token_scores``), and with ``training.packing``
        each micro-batch is its sequences packed in one row of at most ``microbatch_tokens``
        tokens (``forge.engines.titan.packing``); any other ``loss_fn`` sees the logits of
        micro-batches of ``microbatch_size`` padded rows (default ``training.microbatch_size``,
        else all of B). Every micro-batch's ``step_tokens`` / ``step_sequences`` are the counts of
        the whole step (all microbatches of all data-parallel ranks). The loss of each microbatch is its share
        of the step's loss, and the gradient is that of their sum: whatever the microbatch size
        and the number of ranks, a step's gradient is that of one loss over the whole step.
        Metrics are summed likewise, or maximised when the loss output names them ``"max"``;
        every rank returns the same values. A step whose loss or gradient norm is not finite
        changes no parameter and reports ``train/skipped`` 1. ``trainer/*`` metrics say how fast
        the step ran (``forge.engines.titan.throughput``).
        """
        self._require_trainable("train_step")
        if batch.tokens is None:
            raise ValueError("train_step needs batch.tokens, the model's input")
        started = time.perf_counter()
        batch = self._with_step_counts(batch)
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        # A forge loss is computed from token scores, which the output layer computes without
        # the logits; any other callable gets the logits of padded rows.
        scoring = isinstance(loss_fn, Loss) and self.scores_in_head
        timer = PhaseTimer(self.device)

        self.optimizers.zero_grad()
        per_microbatch: dict[str, list[torch.Tensor]] = {}
        reductions: dict[str, str] = {}
        computed_tokens = 0
        plan, idle_passes = self._plan(batch, scoring and self.config.training.packing, microbatch_size)
        with self._compute_context():
            for part in plan.on(self.device):
                microbatch, packed = part.batch, part.packed
                computed_tokens += microbatch.tokens.numel() if packed is None else packed.num_tokens
                with timer.phase("forward"):
                    if scoring:
                        out = loss_fn.from_scores(
                            self._scores(microbatch, packed, loss_fn.temperature, loss_fn.entropy_grad),
                            microbatch,
                        )
                    else:
                        out = loss_fn(self._sampled_logits(microbatch.tokens), microbatch)
                with timer.phase("backward"):
                    (out.loss * self._grad_scale).backward()
                reductions.update(out.reductions)
                for name, value in {"train/loss": out.loss, **out.metrics}.items():
                    # Kept as tensors: one device sync at the end, not one per microbatch.
                    per_microbatch.setdefault(name, []).append(_detached(value))
            for _ in range(idle_passes):
                self._idle_pass(backward=True)
        with timer.phase("optimizer"):
            grad_norm = dist_utils.clip_grad_norm_(
                list(self.model.parameters()), self.config.training.max_norm, foreach=True
            ).item()
        combined = {name: torch.stack(values) for name, values in per_microbatch.items()}
        maxima = {name: v.max() for name, v in combined.items() if reductions.get(name) == "max"}
        sums = {name: v.sum() for name, v in combined.items() if name not in maxima}
        sums["train/tokens"] = torch.tensor(batch.tokens.numel())
        sums["train/response_tokens"] = (batch.loss_mask != 0).sum()  # the generated ones trained
        sums["trainer/sequence_tokens"] = plan.lengths.sum()
        sums["trainer/computed_tokens"] = torch.tensor(computed_tokens)
        sums["trainer/flops"] = torch.tensor(self.flops.of_sequences(plan.lengths), dtype=torch.float64)
        # Reduced before deciding: every rank sees the same values, so all skip or none does.
        metrics = {
            **self._reduce_over_data_parallel(sums, dist.ReduceOp.SUM),
            **self._reduce_over_data_parallel(maxima, dist.ReduceOp.MAX),
        }
        # One inf or nan would make every parameter nan at this step: skip its update.
        skipped = not (math.isfinite(metrics["train/loss"]) and math.isfinite(grad_norm))
        if skipped:
            logger.warning(
                "step %d: loss %s, gradient norm %s: update skipped",
                self.step + 1,
                metrics["train/loss"],
                grad_norm,
            )
            self.optimizers.zero_grad()
        else:
            with timer.phase("optimizer"):
                self.optimizers.step()
        # The schedule and the step count follow the data consumed, skipped or not.
        self.lr_schedulers.step()
        self.step += 1
        for name in ("train/tokens", "train/response_tokens"):
            metrics[name] = int(metrics[name])
        metrics.update(
            {
                "train/grad_norm": grad_norm,
                "train/lr": lr,
                "train/step": self.step,
                "train/skipped": float(skipped),
            }
        )
        counts = {
            name: metrics.pop(f"trainer/{name}") for name in ("sequence_tokens", "computed_tokens", "flops")
        }
        seconds = time.perf_counter() - started
        metrics.update(step_throughput(counts, timer.seconds(), seconds, peak_flops(self.device)))
        return metrics

    def _with_step_counts(self, batch: PolicyBatch) -> PolicyBatch:
        """``batch`` with the loss-token and sequence counts of the step, over the dp ranks."""
        counts = torch.stack(batch.counts()).to(self.device)
        if self.parallel_dims.dp_enabled:
            dist.all_reduce(counts, group=self.parallel_dims.get_mesh("batch").get_group())
        return dataclasses.replace(batch, step_tokens=counts[0].cpu(), step_sequences=counts[1].cpu())

    def _reduce_over_data_parallel(self, values: dict[str, torch.Tensor], op) -> dict[str, float]:
        """``values`` combined with ``op`` over the data-parallel ranks (one collective), as floats."""
        if not values:
            return {}
        names = sorted(values)
        stacked = torch.stack([values[n].to(self.device, torch.float64) for n in names])
        if self.parallel_dims.dp_enabled:
            dist.all_reduce(stacked, op=op, group=self.parallel_dims.get_mesh("batch").get_group())
        return dict(zip(names, stacked.tolist(), strict=True))

    def hf_state_dict(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Full (gathered on every rank) tensors under Hugging Face names; with LoRA, the
        adapters merged into the weights. With ``device`` (an export: ``"cpu"``) each tensor is
        moved there as soon as it is gathered, so the GPU holds one whole weight at a time (a
        GPU that a generator shares has no room for a second copy of an 8B model).

        With ``dtype`` (e.g. the generator's bfloat16) each parameter is cast on its own shard
        before the gather, so the gather moves that dtype's bytes and the float32 master
        weights stay untouched. Without it, the parameter dtype is kept (a merged weight is in
        float32 unless everything is bfloat16), and without sharding the tensors may share
        storage with the live parameters: copy them if they must outlive the next ``train_step``.
        """
        titan_sd = {
            name: _gather(t.detach() if dtype is None else t.detach().to(dtype)).to(device)
            for name, t in self._weights()
        }
        return self.adapter.to_hf(titan_sd)

    def hf_row_shards(self, dtype: torch.dtype | None = None) -> RowShards | None:
        """This rank's rows of each weight under Hugging Face names, cast to `dtype`: what a
        sharded trainer publishes without gathering (`forge.engines.titan.row_shards`); None
        where only whole tensors can be published (tensor parallelism, an adapter that does more
        than rename)."""
        if self.parallel_dims.tp_enabled or not self._hf_row_names:
            return None
        return row_shards(self._weights(), self._hf_row_names, dtype)

    @functools.cached_property
    def _hf_row_names(self) -> dict[str, str] | None:
        return hf_names(self.adapter, [name for name in self._titan_state_dict() if not is_adapter(name)])

    def _titan_state_dict(self) -> dict[str, torch.Tensor]:
        # A compiled block is a wrapper whose own names add `_orig_mod`.
        return {name.replace("._orig_mod", ""): t for name, t in self.model.state_dict().items()}

    def _weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights the model computes with, under torchtitan's names (sharded as the
        parameters are): with LoRA, merged one at a time (``LoraAdapters.merged``)."""
        if self.adapters is None:
            return iter(self._titan_state_dict().items())
        return self.adapters.merged(self._titan_state_dict())

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor], source: str = "a state dict") -> None:
        """Replace the weights (not the optimizer state) with full tensors under HF names. With
        LoRA they become the frozen base, and the adapters start afresh: the model is then
        exactly the weights loaded."""
        titan_shapes = {
            name: t.shape for name, t in get_model_state_dict(self.model).items() if not is_adapter(name)
        }
        expected = expected_hf_shapes(self.adapter, titan_shapes)
        state_dict = check_hf_state_dict(state_dict, expected, self.tied_embeddings, source)
        titan_sd = self.adapter.from_hf(state_dict)
        if self.adapters is not None:
            titan_sd.update(self.adapters.initial(self.config.training.seed))
        set_model_state_dict(self.model, titan_sd, options=StateDictOptions(full_state_dict=True))

    def load_hf_checkpoint(self, path: str | Path) -> None:
        """Load the ``*.safetensors`` of a local Hugging Face checkpoint directory (every rank reads them)."""
        self.load_hf_state_dict(read_safetensors_dir(path), source=str(path))
        logger.info("loaded Hugging Face weights from %s", path)

    def export_hf(
        self, out_dir: str | Path, tokenizer_dir: str | Path | None = None, dtype: str | None = None
    ) -> Path:
        """Write a directory that ``AutoModelForCausalLM.from_pretrained`` loads (rank 0 writes).

        A model loaded from a checkpoint is exported from that checkpoint's files (config,
        generation config, tokenizer) with only the weights changed, in ``dtype`` (default: the
        checkpoint's); a flavor's model gets a config written for it, in the parameters' dtype.
        """
        checkpoint = self.checkpoint_model
        dtype = dtype or (checkpoint.dtype if checkpoint is not None else None)
        hf_sd = self.hf_state_dict(getattr(torch, dtype) if dtype else None, device="cpu")
        if dist.get_rank() == 0:
            if checkpoint is not None:
                config = checkpoint_export_config(checkpoint.path, dtype)
                write_hf_dir(out_dir, hf_sd, config, tokenizer_dir, source_dir=checkpoint.path)
            else:
                config = hf_config(self.config.model.name, self.model_args, hf_sd, self._context_length)
                write_hf_dir(out_dir, hf_sd, config, tokenizer_dir)
        dist.barrier()
        return Path(out_dir)

    def export_peft(self, out_dir: str | Path, base_model_name_or_path: str | None = None) -> Path:
        """Write the LoRA adapters as a PEFT adapter directory (``adapter_config.json``,
        ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the
        base model (every rank gathers, rank 0 writes). ``base_model_name_or_path`` goes into
        the config; default: the checkpoint the engine loaded (``model.hf_path``), if any."""
        if self.adapters is None:
            raise RuntimeError("export_peft needs LoRA adapters: this engine was built without lora")
        if base_model_name_or_path is None and self.checkpoint_model is not None:
            base_model_name_or_path = str(self.checkpoint_model.path)
        titan_sd = self._titan_state_dict()
        adapters = {name: _gather(titan_sd[name].detach()) for name in self.adapters.names()}
        if dist.get_rank() == 0:
            write_peft_dir(out_dir, self.adapters, adapters, self.adapter, base_model_name_or_path)
        dist.barrier()
        return Path(out_dir)

    def hf_adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters alone, full (every rank gathers), under the names of the Hugging Face
        modules they adapt (``forge.engines.titan.lora_export.hf_adapter_tensors``), in their own
        dtype: what weight publishing sends with LoRA. A generator merges them into its own copy
        of the base as ``merged_weight`` does, so they travel unrounded."""
        if self.adapters is None:
            raise RuntimeError(
                "hf_adapter_state_dict needs LoRA adapters: this engine was built without lora"
            )
        titan_sd = self._titan_state_dict()
        adapters = {name: _gather(titan_sd[name].detach()) for name in self.adapters.names()}
        return hf_adapter_tensors(self.adapters, adapters, self.adapter)

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """While active the engine is its base model: ``forward``, ``score_tokens`` and the
        weights read by name (``hf_state_dict``, ``export_hf``) are the frozen base's. For
        scoring and export, not ``train_step`` (the adapters would get no gradient)."""
        if self.adapters is None:
            raise RuntimeError("adapters_disabled needs LoRA adapters: this engine was built without lora")
        with self.adapters.disabled():
            yield

    def save_to(self, directory: str | Path, extra_state: dict[str, Any] | None = None) -> Path:
        """Model, optimizer, LR scheduler, step and ``extra_state`` as a DCP checkpoint in
        ``directory``; not atomic by itself (forge.runs.checkpoint makes the run's checkpoint so).
        With LoRA the model's part is its adapters alone (and the optimizer holds only theirs):
        the frozen base is what the engine starts from, its checkpoint or its seeded flavor."""
        self._require_trainable("save_to")
        save_dcp(self._checkpoint_states(TrainState(self.step, extra_state)), directory)
        return Path(directory)

    def load_from(self, directory: str | Path) -> dict[str, Any]:
        """Restores what ``save_to`` wrote into ``directory``; returns its ``extra_state``."""
        self._require_trainable("load_from")
        train_state = TrainState()
        load_dcp(self._checkpoint_states(train_state), directory)
        self.step = train_state.step
        return train_state.extra_state

    def _checkpoint_states(self, train_state: TrainState) -> dict[str, Any]:
        return {
            "model": ModelWrapper(self.model)
            if self.adapters is None
            else AdapterWeights(self.model, self.adapters.names()),
            "optimizer": self.optimizers,
            "lr_scheduler": self.lr_schedulers,
            "train_state": train_state,
        }

    def _require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"{what} needs a trainable engine; this one was built with trainable=False")


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly sharded) DTensor parameter; a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _detached(value: float | torch.Tensor) -> torch.Tensor:
    return (
        value.detach().to(torch.float64)
        if isinstance(value, torch.Tensor)
        else torch.tensor(float(value), dtype=torch.float64)
    )
