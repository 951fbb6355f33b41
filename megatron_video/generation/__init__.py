"""Generation from a video model under context parallelism: the CP samplers' driver
(``cp_sampling``: noise partitioned with the model's layout, denoised in parallel, gathered),
Wan's sampler on it (``wan_sampling``), the streaming AR generator with a KV cache
(``streaming``) and the families' block model calls (``ar_models``). Called by the trainer's
``train.sample`` and ``megatron-video generate`` through ``Generator`` (``generator``), the
video outputs and option checks (``video_out``) and the Wan folders (``wan_io``), wired to the
trainer's config in ``training.generate``; and by the RL rollouts (``rl``).
Design: docs/generation.md."""
