"""The model families of ``model.family``, one module per family kind, each registering its specs.

``diffusion`` (``video_dit``, ``stdit``, ``ar_dit``), ``video_llava``, ``qwen_vl`` and ``wan`` (``wan``,
``wan_ar``). A new family is one new module here that calls
``register_family(DiffusionFamily(name=..., ...))`` (or its own ``FamilySpec`` subclass) at
import, plus its import line below (docs/architecture.md, "Model
families").
"""

from ..family_spec import FamilySpec, SampleLayout, family_names, get_family, register_family
from . import diffusion, qwen_vl, video_llava, wan
from .diffusion import DiffusionFamily
from .qwen_vl import QwenVLFamily
from .video_llava import VideoLLaVAFamily
from .wan import WanFamily

__all__ = [
    "FamilySpec",
    "SampleLayout",
    "DiffusionFamily",
    "QwenVLFamily",
    "VideoLLaVAFamily",
    "WanFamily",
    "register_family",
    "get_family",
    "family_names",
    "diffusion",
    "qwen_vl",
    "video_llava",
    "wan",
]
