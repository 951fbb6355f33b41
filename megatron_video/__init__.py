"""megatron_video: a Megatron-Core extension that makes long-video training scale.

See docs/architecture.md for the map: 2D attention, Balanced SP with VAE halo, ST-DiT hybrid CP<->DP
and parallel-friendly video DiT pieces.
"""

__version__ = "0.1.0"
