"""The in-process TorchTitan engine shared by the SFT trainer, the GRPO trainer and the reference model.

Modules, one concern each (import from them directly; this package imports nothing so that
reading a config does not pull in torch and torchtitan):

- ``config``: the pydantic configuration (``TitanEngineConfig``).
- ``flavors``: model sizes, including our tiny CPU flavors (``register_flavor``).
- ``job_config``: translation of our config into torchtitan's ``JobConfig``.
- ``runtime``: device selection and the process group.
- ``parallelize``: FSDP/TP/activation checkpointing via the train spec, with two fixes.
- ``hf``: Hugging Face names, safetensors loading and export.
- ``checkpoint``: atomic DCP checkpoints (model, optimizer, LR scheduler, step, extra state).
- ``lora``: LoRA adapters on the frozen model, merged for whatever reads the weights;
  ``lora_export``: the adapters as a PEFT adapter directory.
- ``engine``: ``TitanEngine``, which ties them together.
- ``logprobs``: completions' response logprobs (the reference model's), per data-parallel share.
"""
