"""Compatibility layer: CPU mode for Megatron-Core's CUDA assumptions and API feature detection.

This is the only place in megatron_video that patches Megatron: ``cpu_mode``, only when no GPU is
present and only when asked (``ensure_cpu_mode()`` or ``megatron-video ... --cpu``); and
``checkpoint_writer``, on every device, which gives the checkpoint writer a thread queue for our
synchronous saves (no spawned Manager process per rank).
"""

from .cp_comm_type import (
    core_cp_comm_type,
    layer_cp_comm_type,
    megatron_cp_comm_type_index_base,
    megatron_reads_layer_cp_comm_type,
)
from .cpu_mode import applied_patches, cpu_mode_active, ensure_cpu_mode
from .megatron_api import (
    accepted_kwargs,
    accepts_var_kwargs,
    call_with_accepted_kwargs,
    cpu_optimizer_config_kwargs,
    cpu_transformer_config_kwargs,
    device_transformer_config_kwargs,
    gpu_transformer_config_kwargs,
    initialize_model_parallel,
)

__all__ = [
    "accepted_kwargs",
    "accepts_var_kwargs",
    "applied_patches",
    "call_with_accepted_kwargs",
    "cpu_mode_active",
    "cpu_optimizer_config_kwargs",
    "cpu_transformer_config_kwargs",
    "device_transformer_config_kwargs",
    "gpu_transformer_config_kwargs",
    "ensure_cpu_mode",
    "initialize_model_parallel",
    "core_cp_comm_type",
    "layer_cp_comm_type",
    "megatron_cp_comm_type_index_base",
    "megatron_reads_layer_cp_comm_type",
]
from .state import destroy_model_parallel  # noqa: E402  (teardown helper, see state.py)

__all__ += ["destroy_model_parallel"]
