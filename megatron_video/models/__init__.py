from ..attention.stdit_transitions import frames_to_positions, positions_to_frames  # noqa: F401
from .dit_blocks import (  # noqa: F401
    AdaLNLoRAModulation,
    AdaLNNorm,
    DiTCrossAttention,
    DiTSelfAttention,
    HeadRMSNorm,
    TimestepEmbedder,
)
from .dit_layer import DiTParams, VideoTransformerBlock  # noqa: F401
from .dit_layer_specs import get_stdit_layer_spec  # noqa: F401
from .stdit import STDiTLayer  # noqa: F401
from .vae import CausalConv3d, CausalVideoDecoder, CausalVideoEncoder, CausalVideoVAE  # noqa: F401
