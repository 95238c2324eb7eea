"""LoRA adapters as a PEFT adapter directory, which ``peft.PeftModel.from_pretrained`` loads onto
the Hugging Face base model (and vLLM serves as a LoRA adapter).

PEFT's format: ``adapter_model.safetensors`` holds, for each adapted layer,
``base_model.model.<HF module>.lora_A.weight`` ``[rank, in]`` and ``...lora_B.weight``
``[out, rank]``; ``adapter_config.json`` holds the LoRA settings, with the adapted layers named
as PEFT matches them (a list of names: each module whose name ends with one is adapted).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from forge.engines.titan.hf import written_whole
from forge.engines.titan.lora import LoraAdapters

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def write_peft_dir(
    out_dir: str | os.PathLike,
    adapters: LoraAdapters,
    tensors: dict[str, torch.Tensor],
    state_dict_adapter: BaseStateDictAdapter,
    base_model_name_or_path: str | None,
) -> Path:
    """Writes ``tensors`` (the adapters' full tensors under torchtitan's names) into ``out_dir``,
    which appears only complete."""
    with written_whole(out_dir) as tmp_dir:
        save_file(
            peft_state_dict(adapters, tensors, state_dict_adapter),
            tmp_dir / WEIGHTS_FILE,
            metadata={"format": "pt"},
        )
        config = peft_config(adapters, base_model_name_or_path)
        (tmp_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    logger.info("exported LoRA adapters (PEFT) to %s", out_dir)
    return Path(out_dir)


def peft_state_dict(
    adapters: LoraAdapters, tensors: dict[str, torch.Tensor], state_dict_adapter: BaseStateDictAdapter
) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names, on the CPU."""
    return {
        f"base_model.model.{name}": t.cpu().contiguous()
        for name, t in hf_adapter_tensors(adapters, tensors, state_dict_adapter).items()
    }


def hf_adapter_tensors(
    adapters: LoraAdapters, tensors: dict[str, torch.Tensor], state_dict_adapter: BaseStateDictAdapter
) -> dict[str, torch.Tensor]:
    """The adapters (full tensors under torchtitan's names) under the names of the Hugging Face
    modules they adapt, ``<module>.lora_A.weight`` and ``<module>.lora_B.weight``, with ``B``'s rows
    in Hugging Face's order; on their own device and in their own dtype."""
    state = {}
    for name, hf_module in adapters.hf_modules.items():
        lora_a, lora_b = tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"]
        state[f"{hf_module}.lora_A.weight"] = lora_a.contiguous()
        in_features = adapters.layers[name].in_features
        state[f"{hf_module}.lora_B.weight"] = _in_hf_row_order(lora_b, name, in_features, state_dict_adapter)
    return state


def _in_hf_row_order(
    lora_b: torch.Tensor, name: str, in_features: int, state_dict_adapter: BaseStateDictAdapter
) -> torch.Tensor:
    """``lora_b``'s rows are its layer's output rows, which the state-dict adapter may reorder
    for Hugging Face (torchtitan's Llama 3 permutes the q and k rows): each slice of ``lora_b``
    goes through the adapter in the weight's place, padded with zero columns to its shape."""
    parts = []
    for part in lora_b.split(in_features, dim=1):
        padded = torch.zeros(lora_b.shape[0], in_features, dtype=lora_b.dtype, device=lora_b.device)
        padded[:, : part.shape[1]] = part
        (converted,) = state_dict_adapter.to_hf({f"{name}.weight": padded}).values()
        parts.append(converted[:, : part.shape[1]])
    return torch.cat(parts, dim=1).contiguous()


def peft_config(adapters: LoraAdapters, base_model_name_or_path: str | None) -> dict:
    """``adapter_config.json``: PEFT's LoraConfig for these adapters (its defaults elsewhere)."""
    lora = adapters.config
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in adapters.hf_modules.values()}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
