"""Supervised fine-tuning's data pipeline: the tokenized datasets and their loss masks
(``dataset``, ``masking``), resumable batches (``batches``) and their layout (``collate``). No
Monarch there; the recipe that drives the trainer actor is ``forge.recipes.sft``, and the run's
configuration is ``config``.
"""
