"""Re-export of ``megatron_video.attention.stdit_transitions`` (their home since the layouts <->
models import cycle was removed; see docs/architecture.md, "Layers of the code")."""
from megatron_video.attention.stdit_transitions import frames_to_positions, positions_to_frames

__all__ = ["frames_to_positions", "positions_to_frames"]
