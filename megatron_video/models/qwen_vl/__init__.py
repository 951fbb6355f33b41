"""Qwen2.5-VL on Megatron-Core (docs/qwen_vl.md): ``QwenVLModel`` (GPTModel LLM with M-RoPE and
2D attention + transformers' vision tower), MM-SP under CP, and the HF weights mapping."""

from .config import check_hf_config, language_config, tiny_hf_config
from .model import QwenVLModel, qwen_vl_layer_spec, shift_labels
from .positions import mrope_position_ids
from .weights import mapping_table, to_hf, to_megatron

__all__ = [
    "QwenVLModel",
    "check_hf_config",
    "language_config",
    "mapping_table",
    "mrope_position_ids",
    "qwen_vl_layer_spec",
    "shift_labels",
    "tiny_hf_config",
    "to_hf",
    "to_megatron",
]
