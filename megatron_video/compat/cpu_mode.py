"""CPU mode (placeholder until the compat work lands): no patches yet."""
import torch

_ACTIVE = False


def cpu_mode_active() -> bool:
    return _ACTIVE


def ensure_cpu_mode() -> bool:
    """Activate CPU mode when CUDA is unavailable; return whether it is active."""
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    _ACTIVE = True
    return True
