"""The GRPO run as the library builds it: its configuration (``config``)."""
