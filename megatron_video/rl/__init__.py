"""Reinforcement learning for the diffusion families: Flow-GRPO's SDE sampler, log-probabilities
and clipped loss (``flow_grpo``), its binding to Wan under context parallelism (``wan``) and the
reward registry (``rewards``) and the configuration rules (``rules``); the trainer is
``training.grpo_wan``. Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)"."""
