"""Compatibility layer: CPU mode for Megatron-Core's CUDA assumptions and API feature detection.

This is the only place in megatron_video that patches Megatron (see ``cpu_mode``), and only when no
GPU is present.
"""
from .cpu_mode import cpu_mode_active, ensure_cpu_mode
from .megatron_api import initialize_model_parallel

__all__ = ["cpu_mode_active", "ensure_cpu_mode", "initialize_model_parallel"]
