"""What a model family is (:class:`FamilySpec`) and the registry of families by ``model.family``.

The families live in ``training/families/`` and register here. The built-in ones are loaded on the
first lookup or registration (``_load_builtin``), not at import: this module imports nothing of
``training``, so the config and the command line (``--help``, argument errors) do not import the
models, Megatron-Core among them, until a family is asked for.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = [
    "FamilySpec",
    "SampleLayout",
    "register_family",
    "get_family",
    "family_names",
    "rl_families",
]


@dataclass(frozen=True)
class SampleLayout:
    """How one sample is laid out for the model: the Balanced SP layout (None for plain frame
    order), the token geometry and the number of tokens the model processes per sample."""

    layout: Optional[object]
    geometry: Optional[object]
    seq_length: int


@dataclass(frozen=True, kw_only=True)
class FamilySpec(abc.ABC):
    """One family of ``model.family``: its name, the objectives it admits, its configuration rules
    and the hooks the trainer and the Megatron-LM entry call. Built by keyword; a family kind (a
    subclass) supplies the hooks and its own defaults."""

    name: str
    summary: str
    objectives: Tuple[str, ...]  # admitted diffusion.objective values; first: default
    needs_vae: bool  # latents from the cached causal VAE
    check: Callable[
        [Any, int], None
    ]  # (Config, world_size): family rules (ValueError), called by config.validate
    model_fields: Tuple[str, ...] = ()  # the config's family-only model fields it reads
    # data.buckets (packed micro-batches of mixed-shape clips, training/batches/packed.py): the
    # attention kind inside a clip ("full" / "teacher_forcing"); None: refused, with the rule
    packed_kind: Optional[str] = None
    packed_refusal: str = "it has no packed micro-batch path"
    # train.objective values beyond "supervised" -> "module:Class" of their Trainer subclass
    trainers: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FamilySpec.name ({self.name!r}) must be a non-empty string")
        if (
            not isinstance(self.objectives, tuple)
            or not self.objectives
            or not all(isinstance(o, str) for o in self.objectives)
        ):
            raise ValueError(
                f"FamilySpec.objectives ({self.objectives!r}) of family {self.name!r} "
                f"must be a non-empty tuple of strings (the first is the default)"
            )
        if not callable(self.check):
            raise ValueError(
                f"FamilySpec.check ({self.check!r}) of family {self.name!r} must be "
                f"callable (config, world_size)"
            )

    @property
    def default_objective(self) -> str:
        return self.objectives[0]

    @property
    def objective_note(self) -> str:
        """Appended to the message of a refused objective (why the family admits only its own)."""
        return ""

    def check_objective(self, objective: str) -> None:
        if objective not in self.objectives:
            allowed = " or ".join(repr(o) for o in self.objectives)
            raise ValueError(
                f"diffusion.objective ({objective!r}) must be {allowed} for "
                f"model.family {self.name!r}" + self.objective_note
            )

    def trainer_class(self, config):
        """The ``Trainer`` subclass of ``train.objective`` (``trainers``: "module:Class", loaded
        on use like the built-in families), or None: ``Trainer`` itself (supervised)."""
        spec = dict(self.trainers).get(config.train.objective)
        if spec is None:
            return None
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name)

    def check_rl(self, config) -> None:
        """``train.objective: grpo`` / the ``rl:`` section: the family's rules (``ValueError``);
        families without RL refuse both."""
        raise ValueError(
            f"train.objective ({config.train.objective!r}) and the rl section are for model.family "
            f"in {rl_families()} (the families whose trainers include 'grpo'); {self.name!r} "
            f"trains supervised"
        )

    @abc.abstractmethod
    def transformer_config(self, config, has_gpu: bool = False):
        """The Megatron ``TransformerConfig`` of the model."""

    @abc.abstractmethod
    def build_model(
        self, tcfg, pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None
    ):
        """The model of this pipeline stage."""

    @abc.abstractmethod
    def megatron_lm_config(self, base, config):
        """The model's ``TransformerConfig`` from ``base``, the one Megatron-LM built from its
        command line."""

    @abc.abstractmethod
    def check_megatron_lm_args(self, config, args) -> None:
        """Family rules on Megatron-LM's arguments (``ValueError`` naming the flag); the shared ones
        -- sizes, ``--seq-length`` -- are checked in ``training.megatron_lm``."""

    @abc.abstractmethod
    def make_batches(self, config, **kw):
        """This rank's micro-batch maker (``batches.BatchSource``), built with keywords
        ``coords`` (``batches.RankCoords``), ``vae``, ``latent_scale``, ``layout`` and ``log``
        (the console rank's printer, or None; a family may ignore it)."""

    @abc.abstractmethod
    def sample_layout(self, config, cp_size: int) -> SampleLayout:
        """The layout of one sample on ``cp_size`` context-parallel ranks."""

    @abc.abstractmethod
    def seq_length(self, config) -> int:
        """Tokens per sample that the model processes (no process groups needed)."""

    @abc.abstractmethod
    def make_objective(self, config, groups, sample: SampleLayout):
        """The objective the trainer calls (``model_call``, ``loss``; ``training.objectives``)."""

    def make_packed_objective(self, config):
        """The objective of packed micro-batches (``data.buckets``); ``ValueError`` by default."""
        raise ValueError(
            f"data.buckets is not supported by model.family {self.name!r}: {self.packed_refusal}"
        )

    @property
    def reads_raw_video(self) -> bool:
        """Whether raw clips (``data.source: energon``) are encoded per CP rank in the step: with
        the cached causal VAE (``needs_vae``) or ``raw_video_encoders``."""
        return self.needs_vae

    def raw_video_encoders(self, config):
        """A family without the causal VAE: what encodes ``config``'s raw clips in the step (an
        object with ``encoder`` and ``text``, as ``batches.clips.clip_source`` reads it), or None
        (latents and caption embeddings come precomputed). None by default."""
        return None

    def tokenizer(self, config):
        """The tokenizer of the family's text ids (a transformers tokenizer: ``decode``), which
        hands GRPO's ``rl.reward`` the decoded answer and ``decode``; None (the default): the
        reward gets token ids only."""
        return None

    def checkpoint_files(self, config, params_dtype) -> Dict[str, str]:
        """Extra JSON files (name -> text) each checkpoint of the trainer carries (e.g. what an
        export reads); covered by the checkpoint's manifest. None by default."""
        return {}


_FAMILIES: Dict[str, FamilySpec] = {}
_BUILTIN = "megatron_video.training.families"  # its import registers the built-in families
_builtin_loaded = False


def _load_builtin() -> None:
    """Import the built-in families once (before any lookup, and before a user's family registers,
    so that a clash with a built-in name is reported)."""
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True  # set first: the family modules register while being imported
        try:
            importlib.import_module(_BUILTIN)
        except BaseException:
            _builtin_loaded = False  # a failed import is retried (and raises) at the next lookup
            raise


def register_family(spec: FamilySpec) -> FamilySpec:
    """Make ``spec`` the family of ``model.family: spec.name``; returns ``spec``."""
    _load_builtin()
    if not isinstance(spec, FamilySpec):
        raise ValueError(f"spec ({type(spec).__name__}) must be a FamilySpec")
    if spec.name in _FAMILIES:
        raise ValueError(
            f"model.family {spec.name!r} is already registered "
            f"({type(_FAMILIES[spec.name]).__name__}); family names are unique"
        )
    _FAMILIES[spec.name] = spec
    return spec


def rl_families() -> list:
    """The families whose trainers include ``grpo``."""
    return [n for n in family_names() if dict(get_family(n).trainers).get("grpo")]


def family_names() -> Tuple[str, ...]:
    _load_builtin()
    return tuple(_FAMILIES)


def get_family(name: str) -> FamilySpec:
    """The spec of ``model.family`` ``name``; ``ValueError`` naming it and the registered ones."""
    _load_builtin()
    try:
        return _FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"model.family ({name!r}) must be one of {family_names()}") from None
