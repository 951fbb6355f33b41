"""The model families of ``model.family``, one module per family kind, each registering its specs.

``diffusion`` (``video_dit``, ``stdit``, ``ar_dit``) and ``video_llava``. A new family (e.g. Wan) is
one new module here that calls ``register_family(DiffusionFamily(name="wan", ...))`` (or its own
``FamilySpec`` subclass) at import, plus its import line below (docs/architecture.md, "Model
families").
"""

from ..family_spec import FamilySpec, SampleLayout, family_names, get_family, register_family
from . import diffusion, video_llava
from .diffusion import DiffusionFamily
from .video_llava import VideoLLaVAFamily

__all__ = [
    "FamilySpec",
    "SampleLayout",
    "DiffusionFamily",
    "VideoLLaVAFamily",
    "register_family",
    "get_family",
    "family_names",
    "diffusion",
    "video_llava",
]
