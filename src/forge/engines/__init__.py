"""In-process engines with no Monarch: titan (train/reference), generation engines.

Kept free of imports: import an engine from its own subpackage, e.g.
``from forge.engines.titan.engine import TitanEngine``.
"""
