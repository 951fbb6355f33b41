"""Training on Megatron-Core: config, model families, trainer, checkpoints, CLI, Megatron-LM entry.

Importing the package registers the built-in model families (``training/families/``).
"""

from . import families  # noqa: F401  (registers the families; config looks them up by name)
