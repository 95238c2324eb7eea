"""Thin Monarch actors around forge's engines. Import each from its module
(`forge.actors.trainer.TitanTrainer`, ...): importing one does not load the others' engines."""
