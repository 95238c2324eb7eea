"""Causal attention within documents: the attention of every model the engine builds.

A micro-batch reaches the model either as padded rows (each row one sequence) or packed (one
row of sequences laid end to end, ``forge.engines.titan.packing``). Both are described the same
way, by torchtitan's ``VarlenMetadata``: cumulative sequence starts over the flattened tokens.
On a GPU, in bf16 or fp16, the packed tokens go to flash attention's variable-length kernel
(torch's ``varlen_attn``), which skips the masked blocks. The CPU has no such kernel and the
GPU's takes no float32 (a model without mixed precision, e.g. the GPU demo's SFT): there the
row's sequences are gathered into padded rows for one causal scaled dot-product attention call
and scattered back (under ``torch.compile``, which cannot trace the scatter's data-dependent
shape, the whole row takes the block-diagonal causal mask). One call per layer, not one per
sequence: a loop over 64 sequences made the GPU demo's float32 steps host-bound, 8x slower.

torchtitan's own varlen wrapper is not used: it compiles the kernel with max-autotune at its
first call and does not pass ``enable_gqa``, which torch 2.13 requires for grouped-query heads.
"""

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.varlen import varlen_attn
from torchtitan.models.attention import VarlenMetadata

# torch 2.13's varlen_attn takes a causal window and needs enable_gqa for grouped heads; earlier
# releases take is_causal and read grouped heads from the shapes.
_VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters
_VARLEN_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else {"is_causal": True}
_FLASH_DTYPES = (torch.bfloat16, torch.float16)


def rows_metadata(batch_size: int, width: int, device: torch.device) -> VarlenMetadata:
    """Every row of a ``[batch_size, width]`` batch is one sequence."""
    starts = torch.arange(0, (batch_size + 1) * width, width, dtype=torch.int32, device=device)
    return VarlenMetadata(starts, starts, width, width)


class DocumentAttention(nn.Module):
    """Takes ``xq`` ``[B, H, S, D]`` and ``xk``/``xv`` ``[B, H_kv, S, D]``; returns ``[B * S, H, D]``."""

    def forward(
        self,
        xq: torch.Tensor,
        xk: torch.Tensor,
        xv: torch.Tensor,
        attention_masks: VarlenMetadata,
        scale: float | None = None,
    ) -> torch.Tensor:
        batch, heads, width, head_dim = xq.shape
        grouped = xk.shape[1] != heads
        if xq.is_cuda and xq.dtype in _FLASH_DTYPES:
            packed = [x.transpose(1, 2).flatten(0, 1) for x in (xq, xk, xv)]
            grouped_heads = {"enable_gqa": True} if grouped and "enable_gqa" in _VARLEN_PARAMETERS else {}
            return varlen_attn(
                *packed,
                attention_masks.cu_seq_q,
                attention_masks.cu_seq_k,
                attention_masks.max_q,
                attention_masks.max_k,
                scale=scale,
                **_VARLEN_CAUSAL,
                **grouped_heads,
            )
        if batch > 1:  # rows: plain causal attention per row
            out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, scale=scale, enable_gqa=grouped)
        elif torch.compiler.is_compiling():  # a traced graph cannot loop over the sequences
            mask = _block_causal_mask(attention_masks.cu_seq_q, width)
            out = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=mask, scale=scale, enable_gqa=grouped)
        else:  # one packed row: its sequences as padded rows, one causal call
            out = _attend_as_rows(xq, xk, xv, attention_masks, scale, grouped)
        return out.transpose(1, 2).contiguous().view(batch * width, heads, head_dim)


def _attend_as_rows(xq, xk, xv, attention_masks: VarlenMetadata, scale, grouped: bool) -> torch.Tensor:
    """Causal attention within each sequence of one packed row (``[1, H, S, D]``): gathered into
    ``[sequences, H, longest, D]`` rows padded at their ends (which causal attention keeps from
    the real positions), attended, and the real positions scattered back in packed order."""
    starts = attention_masks.cu_seq_q
    lengths = starts[1:] - starts[:-1]
    offsets = torch.arange(attention_masks.max_q, device=starts.device)
    real = offsets[None, :] < lengths[:, None]
    positions = torch.where(real, starts[:-1, None] + offsets[None, :], 0)

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x[0][:, positions].transpose(0, 1)  # [H, n, L, D] -> [n, H, L, D]

    out = F.scaled_dot_product_attention(
        rows(xq), rows(xk), rows(xv), is_causal=True, scale=scale, enable_gqa=grouped
    )
    return out.transpose(1, 2)[real].transpose(0, 1).unsqueeze(0)  # [1, H, S, D]


def _block_causal_mask(cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    position = torch.arange(width, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:], position, right=True)
    return (sequence[:, None] == sequence[None, :]) & (position[:, None] >= position[None, :])


def use_document_attention(model: nn.Module) -> None:
    """Make every attention layer of a torchtitan model (built with ``attn_type="varlen"``) ours."""
    for module in model.modules():
        if getattr(module, "attn_type", None) == "varlen" and hasattr(module, "inner_attention"):
            module.inner_attention = DocumentAttention()
