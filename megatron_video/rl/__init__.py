"""Reinforcement learning, one home for every GRPO: the options (``config``), the shared parts
(``grpo``: group advantages, the per-token clipped ratio with the k3 KL, token normalisers;
``seeding``: rollout generators keyed by seed, sample and rollout; ``rewards``: the registry, the
checks every reward passes, shipped rewards) used by the VLMs' GRPO (``mmsp.rl``) and the
diffusion GRPO: Flow-GRPO's SDE sampler, log-probabilities and clipped loss with the closed-form
KL (``flow_grpo``), its bindings to Wan and the DiT under context parallelism (``wan``,
``video_dit``) and the configuration rules (``rules``); the trainers are ``training.grpo`` /
``training.grpo_wan``. Maps: docs/mmsp.md ("GRPO"), docs/wan.md, "Reinforcement learning
(Flow-GRPO)"."""
