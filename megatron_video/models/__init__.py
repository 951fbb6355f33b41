"""Video models as Megatron layers. The names below load on first use (PEP 562), so a light
submodule (the caption vocabulary in ``embedders``, the VAE halo probe) imports without Megatron-Core."""

import importlib

_EXPORTS = {
    "frames_to_positions": "..attention.stdit_transitions",
    "positions_to_frames": "..attention.stdit_transitions",
    "AdaLNLoRAModulation": ".dit_blocks",
    "AdaLNNorm": ".dit_blocks",
    "DiTCrossAttention": ".dit_blocks",
    "DiTSelfAttention": ".dit_blocks",
    "HeadRMSNorm": ".dit_blocks",
    "TimestepEmbedder": ".dit_blocks",
    "DiTParams": ".dit_layer",
    "VideoTransformerBlock": ".dit_layer",
    "get_stdit_layer_spec": ".dit_layer_specs",
    "STDiTLayer": ".stdit",
    "CausalConv3d": ".vae",
    "CausalVideoDecoder": ".vae",
    "CausalVideoEncoder": ".vae",
    "CausalVideoVAE": ".vae",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
