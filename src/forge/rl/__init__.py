"""Pure-torch RL building blocks: token ops, losses, group advantages. No Monarch, no actors."""
