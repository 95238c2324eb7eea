"""What keeps a long run alive and resumable: run checkpoints, start-up checks, guards
against bad values and starvation, and actor faults turned into clear errors.

Written for the GRPO app's loops (its run checkpoints serve the SFT app too), over actor
handles, with no loop of its own.
"""

from forge.runs.errors import ActorFailed, RunStopped

__all__ = ["ActorFailed", "RunStopped"]
