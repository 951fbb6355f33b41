from .vae import CausalConv3d, CausalVideoDecoder, CausalVideoEncoder, CausalVideoVAE  # noqa: F401
from .dit_blocks import (AdaLNLoRAModulation, DiTCrossAttention, DiTSelfAttention,  # noqa: F401
                         HeadRMSNorm, TimestepEmbedder, VideoSeqParams)
from .stdit import STDiTLayer, get_stdit_layer_spec  # noqa: F401
from .stdit_transitions import frames_to_positions, positions_to_frames  # noqa: F401
