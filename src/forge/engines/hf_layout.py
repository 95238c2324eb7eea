"""The Hugging Face parameter layout an engine loads weights in: the names and shapes a sender
must provide (each tied tensor once, under its first name) and the tied aliases, with the
check both generation engines make of a received state dict."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HFLayout:
    primary: dict[str, torch.Size]
    # Each extra name of a tied parameter to its primary (``lm_head.weight`` ->
    # ``model.embed_tokens.weight``).
    aliases: dict[str, str]

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> HFLayout:
        primary_by_tensor = {id(p): name for name, p in model.named_parameters()}
        aliases = {
            name: primary_by_tensor[id(p)]
            for name, p in model.named_parameters(remove_duplicate=False)
            if primary_by_tensor[id(p)] != name
        }
        return cls({name: p.shape for name, p in model.named_parameters()}, aliases)

    @classmethod
    def of_config(cls, hf_config, dtype: torch.dtype) -> HFLayout:
        """From a transformers model built on the meta device: no memory, no weights."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return cls.of_model(AutoModelForCausalLM.from_config(hf_config, dtype=dtype))

    def template(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Empty tensors to receive a state dict in (primary parameters only)."""
        return {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in self.primary.items()}

    def problems(self, state_dict: dict[str, torch.Tensor], partial: bool = False) -> list[str]:
        """What keeps `state_dict` from loading: missing (unless `partial`: some of the weights
        only), unexpected and misshapen parameters."""
        missing = [] if partial else sorted(self.primary.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - self.primary.keys() - self.aliases.keys())
        mismatched = [
            f"{name}: got {tuple(t.shape)}, expected {tuple(self.primary[name])}"
            for name, t in state_dict.items()
            if name in self.primary and tuple(t.shape) != tuple(self.primary[name])
        ]
        return [
            f"{what} {names}"
            for what, names in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("shape mismatches", mismatched),
            )
            if names
        ]

    def named_tensors(self, state_dict: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Every primary parameter of `state_dict`, then each alias with its primary's tensor."""
        weights = [(name, state_dict[name]) for name in self.primary]
        return weights + [(alias, state_dict[primary]) for alias, primary in self.aliases.items()]


def mismatch_error(target: str, problems: list[str]) -> ValueError:
    return ValueError(
        f"cannot load state dict into {target}: "
        + "; ".join(problems)
        + ". The sender must use the same architecture and Hugging Face parameter names."
    )
