"""The GRPO run as the library builds it: its configuration (``config``), the warm start
(``warm_start``), one launch per actor section (``launch``) and the run itself (``run``). The
loops it drives are ``forge.runs.grpo_loops``.
"""
