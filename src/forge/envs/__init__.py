"""Environments for tool-using agents: the sandbox that runs model-written code."""
