"""Training on Megatron-Core: config, model families, trainer, checkpoints, CLI, Megatron-LM entry.

The built-in model families (``training/families/``) register on the first lookup
(``family_spec.get_family``), so importing this package or its command line is light.
"""
