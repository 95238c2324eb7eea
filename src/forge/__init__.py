"""forge: PyTorch-native RL post-training built from Monarch actors."""

__version__ = "0.1.0"
