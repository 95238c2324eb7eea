"""A generation engine on a transformers causal LM: the CPU engine, and a GPU fallback.

The sampling loop is written here on top of the model's forward with a KV cache instead of
``model.generate``: we must report exactly the logprobs of the distribution each token was
sampled from (see ``forge.engines.generation``), which needs full control of the
processing between logits and sampling.
"""

import logging
from collections.abc import Iterable, Sequence
from os import PathLike

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from forge.engines.generation import (
    GeneratedSequence,
    GenerationEngine,
    SamplingParams,
    StopStrings,
    check_generate_inputs,
    sample_seed,
    stop_strings,
)
from forge.engines.hf_layout import HFLayout, mismatch_error

logger = logging.getLogger(__name__)


class HFGenerateEngine(GenerationEngine):
    """Batched sampling of ``len(prompts) * n`` sequences at once, left padded.

    The model is put in eval mode with gradients off; it keeps its device and dtype (the
    constructors below make it float32 on CPU unless told otherwise). ``tokenizer`` decodes
    samples for stop strings (``SamplingParams.stop``); a row stops as soon as one is completed.
    With a tokenizer, only ids it can decode are sampled: a checkpoint may have more vocabulary
    rows than its tokenizer has tokens (Qwen pads them), and the distribution sampled from (and
    its logprobs) is the softmax over the first ``len(tokenizer)`` rows, as the trainer's
    (``ModelConfig.sampled_rows``).
    """

    def __init__(
        self, model: PreTrainedModel, eos_token_id: int | Sequence[int] | None = None, tokenizer=None
    ):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.sampled_rows = None if tokenizer is None else len(tokenizer)
        if eos_token_id is None:
            eos_token_id = model.generation_config.eos_token_id
        if eos_token_id is None:
            eos_token_id = model.config.eos_token_id
        if eos_token_id is None:
            eos_token_id = []
            logger.warning("model has no eos_token_id: samples stop only at stop_token_ids or max_tokens")
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        # Left-padding positions are masked out of attention, so any valid id would do.
        self.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    @classmethod
    def from_pretrained(
        cls, path: str | PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "HFGenerateEngine":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model)

    @classmethod
    def from_config(
        cls,
        config: PretrainedConfig,
        state_dict: dict[str, torch.Tensor] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "HFGenerateEngine":
        """Builds the model from a config; its weights are random unless ``state_dict`` is given."""
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
        engine = cls(model)
        if state_dict is not None:
            engine.load_hf_state_dict(state_dict)
        return engine

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def receive_device(self) -> torch.device:
        return self.model.device

    def hf_weight_shapes(self) -> dict[str, torch.Size]:
        return HFLayout.of_model(self.model).primary

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        sample_keys: Sequence[int] | None = None,
    ) -> list[list[GeneratedSequence]]:
        if not prompt_ids:
            return []
        check_generate_inputs(prompt_ids, sample_keys)
        stops = stop_strings(self.tokenizer, params)
        uniforms = None
        if params.seed is not None and params.temperature > 0.0:
            uniforms = _row_uniforms(params, sample_keys or range(len(prompt_ids))).to(self.device)

        # Row r samples prompt r // n: the n samples of a prompt are adjacent.
        rows = [list(p) for p in prompt_ids for _ in range(params.n)]
        input_ids, attention_mask = self._left_pad(rows)
        # Positions count real tokens only, so a left-padded prompt sees the same positions
        # as it would alone.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        stop_ids = torch.tensor(
            self.eos_token_ids + params.stop_token_ids, dtype=torch.long, device=self.device
        )

        num_rows = len(rows)
        finished = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        step_tokens: list[torch.Tensor] = []
        step_logprobs: list[torch.Tensor] = []
        responses: list[list[int]] = [[] for _ in range(num_rows)]  # filled only for stop strings

        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        for step in range(params.max_tokens):
            tokens, logprobs = _sample(logits, params, None if uniforms is None else uniforms[:, step])
            tokens = tokens.masked_fill(finished, self.pad_token_id)
            step_tokens.append(tokens)
            step_logprobs.append(logprobs)
            lengths += (~finished).long()
            just_stopped = ~finished & torch.isin(tokens, stop_ids)
            if stops is not None:
                just_stopped |= self._completes_stop_string(tokens, finished, responses, stops)
            stopped |= just_stopped
            finished |= just_stopped
            if bool(finished.all()) or step == params.max_tokens - 1:
                break
            # Finished rows keep running (their outputs are discarded): dropping them would
            # mean re-indexing the cache every step, which costs more than it saves here.
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(num_rows, 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            logits = self._forward(tokens[:, None], attention_mask, position_ids, cache)

        all_tokens = torch.stack(step_tokens, dim=1).tolist()
        all_logprobs = torch.stack(step_logprobs, dim=1).tolist()
        sequences = [
            GeneratedSequence(
                token_ids=tokens[:length],
                logprobs=logprobs[:length],
                stop_reason="stop" if row_stopped else "length",
            )
            for tokens, logprobs, length, row_stopped in zip(
                all_tokens, all_logprobs, lengths.tolist(), stopped.tolist(), strict=True
            )
        ]
        return [sequences[i : i + params.n] for i in range(0, num_rows, params.n)]

    def _completes_stop_string(
        self, tokens: torch.Tensor, finished: torch.Tensor, responses: list[list[int]], stops: StopStrings
    ) -> torch.Tensor:
        """Appends this step's tokens to the running rows' ``responses``; True where one completes a
        stop string."""
        completes = []
        for response, token, done in zip(responses, tokens.tolist(), finished.tolist(), strict=True):
            if not done:
                response.append(token)
            completes.append(not done and stops.ends_with_stop(response))
        return torch.tensor(completes, device=self.device)

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """Returns float32 logits of the last position; appends to ``cache``."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, : self.sampled_rows].float()

    def hf_state_dict_template(self) -> dict[str, torch.Tensor]:
        return {name: torch.empty_like(p) for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies ``state_dict`` into the parameters in place; dtype and device are converted.

        Every parameter must be present. A tied alias (``lm_head.weight`` when the embeddings
        are tied) may also be present, and must then equal its primary: a trainer with untied
        weights cannot be loaded into a tied model without losing one of them.
        """
        layout = HFLayout.of_model(self.model)
        untied = [
            f"{alias} differs from {primary}"
            for alias, primary in layout.aliases.items()
            if alias in state_dict
            and primary in state_dict
            and not torch.equal(state_dict[alias].to(state_dict[primary].device), state_dict[primary])
        ]
        problems = layout.problems(state_dict)
        if untied:
            problems.append(f"tied weights that differ {untied} (the model ties them; the sender does not)")
        if problems:
            raise mismatch_error(type(self.model).__name__, problems)
        # named_parameters: each tied tensor once, under its primary name.
        for name, param in self.model.named_parameters():
            param.copy_(state_dict[name])

    @torch.no_grad()
    def load_hf_weights(self, chunks: Iterable[dict[str, torch.Tensor]]) -> None:
        """Copies each chunk's weights (some of the parameters, by primary name) in place."""
        layout = HFLayout.of_model(self.model)
        parameters = dict(self.model.named_parameters())
        for weights in chunks:
            if problems := layout.problems(weights, partial=True):
                raise mismatch_error(type(self.model).__name__, problems)
            for name, tensor in weights.items():
                parameters[name].copy_(tensor)


def _row_uniforms(params: SamplingParams, keys: Sequence[int]) -> torch.Tensor:
    """``[rows, max_tokens]`` uniforms; row ``i * n + j`` (sample j of prompt i) comes from its
    own generator seeded by ``(seed, keys[i], j)``, so it does not depend on the batch."""
    rows = []
    for key in keys:
        for j in range(params.n):
            stream = torch.Generator().manual_seed(sample_seed(params.seed, key, j))
            rows.append(torch.rand(params.max_tokens, generator=stream, dtype=torch.float64))
    return torch.stack(rows)


def _sample(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row; returns the tokens and their logprobs under the distribution
    sampled from (see ``forge.engines.generation`` for the exact semantics). With ``uniforms``
    (one per row), by inverse transform sampling: each row's draw is its own."""
    if params.temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        logprobs = torch.log_softmax(_filter(logits / params.temperature, params), dim=-1)
        probs = logprobs.exp()
        if uniforms is None:
            tokens = torch.multinomial(probs, num_samples=1).squeeze(-1)
        else:
            tokens = _inverse_transform(probs.double(), uniforms)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _inverse_transform(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds ``u * total``: a token of zero
    probability can never be it, except past the end through rounding, where the last token
    of nonzero probability is taken instead."""
    cdf = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
    last_possible = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(tokens >= probs.shape[-1], last_possible, tokens)


def _filter(scaled_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k then top-p: removed tokens get ``-inf``. The most likely token is always kept."""
    if params.top_k > 0 and params.top_k < scaled_logits.shape[-1]:
        kth_largest = torch.topk(scaled_logits, params.top_k, dim=-1).values[:, -1:]
        scaled_logits = scaled_logits.masked_fill(scaled_logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled_logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Remove a token when the tokens more likely than it already reach top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove_sorted = mass_before >= params.top_p
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scaled_logits = scaled_logits.masked_fill(remove, float("-inf"))
    return scaled_logits
