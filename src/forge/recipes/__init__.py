"""Reusable pieces of the apps' recipes (``apps/sft``), kept out of the apps so they stay wiring only."""
