"""Datasets, tokenizers, rewards and the embedded toy task. No Monarch here.

Import the submodules directly (``forge.data.types``, ``forge.data.prompts``, ...): this
package imports nothing eagerly, so that ``forge.data.types`` stays cheap to import.
"""
