"""Training configuration: one dataclass per YAML section, loading with ``section.key=value``
overrides, and ``validate``: each section checks its own fields (``Section.validate``), the
top-level ``validate`` the rules between sections and the family's own (``training.family_spec``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import yaml

from ..data.buckets import BucketConfig, BucketGrid
from ..models.vae_geometry import VAEGeometry, project_vae_geometry, wan_vae_folder_geometry
from ..parallel.topology import check_ranks_per_node, check_ulysses_in_node, default_cp_groups
from ..rl.config import RLConfig
from .family_spec import get_family

__all__ = [
    "ModelSection",
    "ParallelSection",
    "DataSection",
    "VAESection",
    "DiffusionSection",
    "TrainSection",
    "Config",
    "load_config",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "validate",
    "vae_geometry",
    "vae_fits_data",
    "latent_shape",
    "token_grid_of",
    "data_parallel_size",
    "bucket_grid",
]

OBJECTIVES = ("edm", "flow", "lm")  # lm: next-token cross-entropy (model.family video_llava)
NONFINITE_POLICIES = ("skip", "stop")
PATH_FIELDS = ("vae.weights", "vae.diffusers", "data.text_encoder", "model.hf_config")  # to YAML
TEMPORAL_STRIDE, SPATIAL_STRIDE = 4, 8  # the project's causal VAE (models.vae)
BUCKET_DERIVED = ("patch_size", "spatial_stride", "temporal_stride")  # bucket_grid sets them


def _pos_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} ({value!r}) must be an integer >= {minimum}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} ({value!r}) must be a positive number")


@dataclass
class ModelSection:
    family: str = "ar_dit"  # a registered family (training/families/)
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size
    lora_rank: int = 16  # AdaLN-LoRA rank
    patch_size: List[int] = field(default_factory=lambda: [1, 1, 1])  # (pt, ph, pw) on latents
    rope_theta: Optional[float] = 10000.0
    init_std: float = 0.02
    frames_per_block: int = 2  # ar_dit: latent frames per autoregressive block
    stdit_variant: str = "hybrid"  # stdit: hybrid | cp_everywhere | ulysses_everywhere
    stdit_full_attention_layers: List[int] = field(default_factory=list)
    # wan / wan_ar (training/families/wan.py): weights to start from -- a diffusers
    # WanTransformer3DModel folder or a checkpoint from models/wan/convert.py; timestep per token
    init_from: Optional[str] = None
    per_token_timesteps: bool = False
    hf_config: Optional[str] = None  # qwen_vl: a Qwen2.5-VL config.json / folder, every shape

    def validate(self) -> None:
        m = self
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "lora_rank",
            "frames_per_block",
        ):
            _pos_int(f"model.{name}", getattr(m, name))
        if not isinstance(m.patch_size, (list, tuple)) or len(m.patch_size) != 3:
            raise ValueError(
                f"model.patch_size ({m.patch_size!r}) must be a list of 3 integers (pt, ph, pw)"
            )
        for i, ps in enumerate(m.patch_size):
            _pos_int(f"model.patch_size[{i}]", ps)
        H = m.num_attention_heads
        G = m.num_query_groups or H
        if H % G:
            raise ValueError(
                f"model.num_attention_heads ({H}) must be divisible by model.num_query_groups ({G})"
            )
        if m.hidden_size % H:
            raise ValueError(
                f"model.hidden_size ({m.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({H})"
            )
        head_dim = m.hidden_size // H
        if m.rope_theta is not None and (head_dim % 2 or head_dim < 6):
            raise ValueError(
                f"model.hidden_size / model.num_attention_heads ({head_dim}) must be "
                f"even and >= 6 for 3D RoPE (or set model.rope_theta: null)"
            )


@dataclass
class ParallelSection:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1  # = ulysses_size * ring_size
    ulysses_size: int = 1  # all-to-all group, inside a node
    ring_size: int = 1  # P2P ring, across nodes
    placement: str = "ulysses_inner"
    ranks_per_node: Optional[int] = None  # default: LOCAL_WORLD_SIZE / --ranks-per-node / world
    ring_balance: Optional[bool] = (
        None  # ar_dit: zigzag frame pairing over the ring (default R > 1)
    )
    recompute: bool = False  # activation checkpointing of every layer (composes with SP)
    fsdp: bool = False  # ZeRO-3: weights, gradients, optimizer state sharded over DP x CP
    auto: bool = False  # `parallel: auto`: the planner picks the layout (training/planning.py)

    def validate(self, world_size: int) -> None:
        p = self
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "ulysses_size",
            "ring_size",
        ):
            _pos_int(f"parallel.{name}", getattr(p, name))
        TP, PP, CP, U, R = (
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.context_parallel_size,
            p.ulysses_size,
            p.ring_size,
        )
        if U * R != CP:
            raise ValueError(
                f"parallel.ulysses_size * parallel.ring_size ({U} * {R} = {U * R}) "
                f"must equal parallel.context_parallel_size ({CP})"
            )
        if p.placement not in ("ulysses_inner", "ring_inner"):
            raise ValueError(
                f"parallel.placement ({p.placement!r}) must be 'ulysses_inner' or 'ring_inner'"
            )
        if world_size % (TP * PP * CP):
            raise ValueError(
                f"world size ({world_size}) must be divisible by parallel.tensor_model_parallel_size "
                f"* pipeline_model_parallel_size * context_parallel_size ({TP} * {PP} * {CP})"
            )
        if p.ranks_per_node is not None:  # the node-placement rule lives in parallel.topology
            check_ranks_per_node(p.ranks_per_node, world_size, "parallel.ranks_per_node")
            check_ulysses_in_node(
                default_cp_groups(world_size, TP, CP),
                U,
                R,
                p.ranks_per_node,
                p.placement,
                tp_size=TP,
                prefix="parallel.",
            )
        for name in ("recompute", "fsdp"):
            if not isinstance(getattr(p, name), bool):
                raise ValueError(f"parallel.{name} ({getattr(p, name)!r}) must be true or false")
        if p.fsdp and PP > 1:  # Megatron's schedule syncs the stages' embedders in DDP buffers
            raise ValueError(f"parallel.fsdp (True) needs parallel.pipeline_model_parallel_size 1 "
                             f"(got {PP}): the pipeline schedule reduces the replicated embedders' "
                             "gradients in DDP's buffers")  # fmt: skip


@dataclass
class DataSection:
    source: str = "synthetic"  # synthetic | shards | energon
    shards: Optional[str] = None  # folder / glob of WebDataset shards (source=shards)
    path: Optional[str] = None  # energon dataset from `megatron-video prepare` (source=energon)
    text_embed_dim: Optional[int] = (
        None  # shards from `precompute --text-encoder`: condition on the stored
    )
    # caption embeddings of this width (caption_len = their length)
    text_encoder: Optional[str] = None  # wan / wan_ar raw video: a local UMT5 / T5 folder
    num_samples: int = 100000  # synthetic: dataset size
    num_frames: int = 29  # raw frames, 1 + 4k
    height: int = 32
    width: int = 32
    caption_len: int = 16
    seed: int = 0
    # mixed lengths and shapes: data.buckets.<field> of data.buckets.BucketConfig (patch and
    # strides come from model.patch_size and the VAE); read by `megatron-video buckets`,
    # `precompute` and, with data.source shards or energon, training (packed micro-batches)
    buckets: Optional[dict] = None
    # wan / wan_ar: the share of samples trained as I2V (first latent frame = the clean image,
    # timestep 0, no loss; Wan 2.2 TI2V); null: training/ti2v.py's default
    i2v_probability: Optional[float] = None

    def validate(self) -> None:
        d = self
        p = d.i2v_probability
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1
        ):
            raise ValueError(f"data.i2v_probability ({p!r}) must be a number in [0, 1] (or null)")
        if d.buckets is not None:
            derived = (
                sorted(set(d.buckets) & set(BUCKET_DERIVED)) if isinstance(d.buckets, dict) else []
            )
            if derived:
                raise ValueError(
                    f"data.buckets.{derived[0]} ({d.buckets[derived[0]]!r}) is not a field here: "
                    f"the grid takes model.patch_size and the VAE's strides"
                )
            BucketConfig.from_dict(d.buckets, prefix="data.buckets.")
        if d.source not in ("synthetic", "shards", "energon"):
            raise ValueError(
                f"data.source ({d.source!r}) must be 'synthetic', 'shards' or 'energon'"
            )
        if d.text_embed_dim is not None:
            _pos_int("data.text_embed_dim", d.text_embed_dim)
            if d.source != "shards" and d.text_encoder is None:
                raise ValueError(
                    f"data.text_encoder (None) must name a UMT5 / T5 folder with data.text_embed_dim "
                    f"({d.text_embed_dim}) and data.source {d.source!r} (captions encoded in the "
                    f"step), or data.source be 'shards' (embeddings from `precompute`)"
                )
        if d.source == "energon" and not d.path:
            raise ValueError(
                "data.path (None) must name an energon dataset (`megatron-video "
                "prepare SRC DST`) when data.source is 'energon'"
            )
        if d.source == "shards" and not d.shards:
            raise ValueError(
                "data.shards (None) must name a folder or glob of .tar shards when "
                "data.source is 'shards'"
            )
        for name in ("num_frames", "height", "width"):  # the VAE's strides: _vae_fits_data
            _pos_int(f"data.{name}", getattr(d, name))
        _pos_int("data.num_samples", d.num_samples)
        _pos_int("data.caption_len", d.caption_len)


@dataclass
class VAESection:
    weights: Optional[str] = None  # trained weights (.pt; relative to the YAML file); default:
    # train once and cache under cache_dir
    cache_dir: str = "runs/cache"
    latent_channels: int = 4
    base_channels: int = 16
    train_steps: int = 300
    batch_size: int = 4
    lr: float = 2e-3
    kl_weight: float = 1e-6
    foreground_weight: float = 4.0  # extra loss weight on the shapes' pixels
    # an integer >= 0 (the user's choice, as LongLive's vae_halo_latents) or "auto" (null): the
    # smallest exact halo, probed once per VAE (training/vae_halo.py)
    halo_latents: Any = "auto"
    diffusers: Optional[str] = None  # a local diffusers AutoencoderKLWan folder (2.1 or 2.2)

    def validate(self) -> None:
        v = self
        for name in ("latent_channels", "base_channels", "train_steps", "batch_size"):
            _pos_int(f"vae.{name}", getattr(v, name), 0 if name == "train_steps" else 1)
        _positive("vae.lr", v.lr)
        if v.halo_latents is not None and v.halo_latents != "auto":
            if isinstance(v.halo_latents, bool) or not isinstance(v.halo_latents, int):
                raise ValueError(
                    f"vae.halo_latents ({v.halo_latents!r}) must be 'auto' or an integer >= 0"
                )
            _pos_int("vae.halo_latents", v.halo_latents, 0)
        if v.diffusers is not None:
            wan_vae_folder_geometry(v.diffusers)  # ValueError naming the folder / key
        if v.weights is not None and not Path(v.weights).is_file():
            raise ValueError(
                f"vae.weights ({v.weights!r}) must be an existing file (or null to "
                f"train and cache the VAE)"
            )


@dataclass
class DiffusionSection:
    objective: Optional[str] = None  # edm | flow (default: flow for ar_dit, edm otherwise)
    sigma_data: float = 1.0  # latents are scaled to unit variance
    p_mean: float = -0.4
    p_std: float = 1.2
    flow_shift: float = 1.0  # flow timesteps t -> shift t / (1 + (shift - 1) t) (Wan's shift)
    flow_distribution: str = "logit_normal"  # flow t before the shift: logit_normal | uniform
    cfg_dropout: float = 0.1  # probability of training with the null caption
    guidance_scale: float = 3.0
    sampler: str = "heun"  # heun | euler (EDM); flow always uses Euler
    sample_steps: int = 16

    def validate(self) -> None:
        """The numeric fields; ``objective`` against the family in the top-level ``validate``."""
        df = self
        for name in ("sigma_data", "p_std", "flow_shift"):
            _positive(f"diffusion.{name}", getattr(df, name))
        if not 0.0 <= df.cfg_dropout <= 1.0:
            raise ValueError(f"diffusion.cfg_dropout ({df.cfg_dropout}) must be in [0, 1]")
        if df.flow_distribution not in ("logit_normal", "uniform"):
            raise ValueError(
                f"diffusion.flow_distribution ({df.flow_distribution!r}) must be "
                f"'logit_normal' or 'uniform'"
            )
        if df.sampler not in ("heun", "euler"):
            raise ValueError(f"diffusion.sampler ({df.sampler!r}) must be 'heun' or 'euler'")
        _pos_int("diffusion.sample_steps", df.sample_steps)


@dataclass
class TrainSection:
    steps: int = 200
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # default micro_batch_size * data-parallel size
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 1
    save_interval: int = 0  # 0: save once at the end
    save: bool = True
    resume: bool = True  # continue from <output>/checkpoints when present
    sample: bool = True  # write sample.gif at the end
    sample_batch: int = 1
    tensorboard: bool = True
    bf16: bool = False  # GPU only
    progress: bool = True
    nonfinite_policy: str = "stop"  # non-finite loss / grad norm: skip (count, no update) | stop
    max_skipped_steps: int = 10  # policy skip: stop after this many skipped steps in a row
    rank_timeout_s: float = 300.0  # a rank that makes no progress this long ends the job
    objective: str = "supervised"  # supervised | grpo (video_llava, qwen_vl: the rl section)

    def validate(self, has_gpu: Optional[bool] = None) -> None:
        """Every field but the global batch; ``has_gpu`` None: no device rule (validate)."""
        t = self
        _pos_int("train.steps", t.steps, 0)
        _pos_int("train.micro_batch_size", t.micro_batch_size)
        _pos_int("train.log_interval", t.log_interval)
        _pos_int("train.save_interval", t.save_interval, 0)
        _pos_int("train.warmup_steps", t.warmup_steps, 0)
        _pos_int("train.sample_batch", t.sample_batch)
        _positive("train.lr", t.lr)
        if not 0 <= t.min_lr <= t.lr:
            raise ValueError(f"train.min_lr ({t.min_lr}) must be in [0, train.lr ({t.lr})]")
        if t.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(
                f"train.lr_decay_style ({t.lr_decay_style!r}) must be constant, "
                f"linear, cosine or inverse-square-root"
            )
        if t.clip_grad < 0:
            raise ValueError(f"train.clip_grad ({t.clip_grad}) must be >= 0 (0 disables clipping)")
        if t.nonfinite_policy not in NONFINITE_POLICIES:
            raise ValueError(
                f"train.nonfinite_policy ({t.nonfinite_policy!r}) must be one of "
                f"{NONFINITE_POLICIES}"
            )
        _pos_int("train.max_skipped_steps", t.max_skipped_steps)
        _positive("train.rank_timeout_s", t.rank_timeout_s)
        if t.objective not in ("supervised", "grpo"):
            raise ValueError(f"train.objective ({t.objective!r}) must be 'supervised' or 'grpo'")
        if t.bf16 and has_gpu is False:
            raise ValueError("train.bf16 (True) needs a GPU; CPU runs train in fp32")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    vae: VAESection = field(default_factory=VAESection)
    diffusion: DiffusionSection = field(default_factory=DiffusionSection)
    train: TrainSection = field(default_factory=TrainSection)
    rl: RLConfig = field(default_factory=RLConfig)  # train.objective grpo (rl.config)
    output: str = "runs/train"

    @property
    def objective(self) -> str:
        """``diffusion.objective``, or the family's default where it is null."""
        if self.diffusion.objective is not None:
            return self.diffusion.objective
        return get_family(self.model.family).default_objective


# ----------------------------------------------------------------------------------------------
# Loading
def _section_from_dict(cls, data: Any, where: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"{where} ({data!r}) must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
    return cls(**{k: _coerce(v, fields[k].type, f"{where}.{k}") for k, v in data.items()})


def _coerce(value, annotation, name: str):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string: accept it for float fields."""
    if isinstance(value, str) and "float" in str(annotation):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name} ({value!r}) must be a number") from None
    return value


def config_from_dict(data: Optional[dict]) -> Config:
    """``Config`` from a nested dict (the YAML structure); unknown keys raise ``ValueError``."""
    data = dict(data or {})
    sections = {f.name: f for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(f"config: unknown section(s) {unknown}; known: {sorted(sections)}")
    kwargs = {}
    for name, f in sections.items():
        if name not in data:
            continue
        if name == "output":
            kwargs[name] = str(data[name])
        elif name == "parallel" and data[name] == "auto":  # the planner picks the layout
            kwargs[name] = ParallelSection(auto=True)
        else:
            kwargs[name] = _section_from_dict(f.default_factory().__class__, data[name], name)
    return Config(**kwargs)


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``section.key=value`` strings to a nested dict (values parsed as YAML scalars/lists)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override ({item!r}) must look like section.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override ({item!r}): {p} is not a section")
        node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
    return data


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    """Read ``path`` (YAML; None = defaults), apply ``overrides``, return a ``Config``."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config ({path!r}) must be an existing YAML file")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config ({path!r}) must hold a mapping of sections")
        for sec, key in (name.split(".") for name in PATH_FIELDS):
            value = (data.get(sec) or {}).get(key)  # relative to the YAML file, not the CWD
            if value and not Path(value).is_absolute():
                data[sec][key] = str((p.parent / value).resolve())
    return config_from_dict(apply_overrides(data, overrides))


# ----------------------------------------------------------------------------------------------
# Derived quantities
def vae_geometry(config: Config) -> VAEGeometry:
    """The VAE's channels and strides (``models.vae_geometry``): read from ``vae.diffusers``'s
    config (Wan 2.1: 8x spatial, Wan 2.2: 16x), else the project's causal VAE (4x / 8x)."""
    v = config.vae
    if v.diffusers is not None:
        return wan_vae_folder_geometry(v.diffusers)
    return project_vae_geometry(v.latent_channels)


def latent_shape(config: Config) -> Tuple[int, int, int]:
    """``(F, h, w)`` latent frames and size of a sample (``data.height`` / ``width`` are pixels)."""
    d, g = config.data, vae_geometry(config)
    return (
        1 + (d.num_frames - 1) // g.temporal_stride,
        d.height // g.spatial_stride,
        d.width // g.spatial_stride,
    )


def token_grid_of(config: Config) -> Tuple[int, int, int]:
    """``(T', H', W')`` token grid of a sample after patchify."""
    F, h, w = latent_shape(config)
    pt, ph, pw = config.model.patch_size
    return F // pt, h // ph, w // pw


def bucket_grid(config: Config) -> BucketGrid:
    """The bucket grid of ``data.buckets`` (defaults where null) at ``model.patch_size`` and the
    VAE's strides; ``ValueError`` names ``data.buckets``."""
    fields = dict(config.data.buckets or {})
    g = vae_geometry(config)
    fields.update(
        patch_size=list(config.model.patch_size),
        spatial_stride=g.spatial_stride,
        temporal_stride=g.temporal_stride,
    )
    cfg = BucketConfig.from_dict(fields, prefix="data.buckets.")
    try:
        return BucketGrid(cfg)
    except ValueError as e:
        raise ValueError(f"data.buckets: {e}") from None


def data_parallel_size(config: Config, world_size: int) -> int:
    p = config.parallel
    return world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )


# ----------------------------------------------------------------------------------------------
# Validation: each section's own fields, then the rules between sections and the family's
def validate(config: Config, world_size: int, has_gpu: Optional[bool] = None) -> None:
    """Raise ``ValueError`` (naming the field) for any configuration that cannot run on
    ``world_size`` ranks. ``has_gpu`` (the run passes it): None checks a config for the machines it
    will run on (``megatron-video validate``), leaving the device rules to the run."""
    _pos_int("world_size", world_size)
    family = get_family(config.model.family)  # ValueError naming model.family
    config.model.validate()
    config.parallel.validate(world_size)
    _model_fits_parallel(config)
    config.data.validate()
    config.vae.validate()
    if "lm" not in family.objectives:  # the VLM families take pixels: no VAE, no 1 + 4k frames
        vae_fits_data(config)
    _patch_fits_latents(config)
    if config.data.buckets is not None:
        _check_buckets(config, family)
    _family_fields(config, family)
    family.check(config, world_size)  # the family's own rules (training/families/)
    objective = config.objective
    if objective not in OBJECTIVES:
        raise ValueError(f"diffusion.objective ({objective!r}) must be one of {OBJECTIVES}")
    family.check_objective(objective)
    config.diffusion.validate()
    config.train.validate(has_gpu)
    if config.train.objective == "grpo" or config.rl != RLConfig():
        family.check_rl(config)  # the family's RL rules; the others refuse both
    _global_batch_fits(config, world_size)
    PP = config.parallel.pipeline_model_parallel_size
    if config.train.sample and PP > 1:
        raise ValueError(
            f"train.sample (True) is not supported with parallel.pipeline_model_parallel_size "
            f"({PP}) > 1; set train.sample=false"
        )


def _check_buckets(config: Config, family) -> None:
    """Training on mixed shapes (``data.buckets``: packed micro-batches, training/batches/packed.py)."""
    d, t = config.data, config.train
    if family.packed_kind is None:
        family.make_packed_objective(config)  # raises, naming the family's rule
    if d.source not in ("shards", "energon"):
        raise ValueError(
            f"data.source ({d.source!r}) must be 'shards' or 'energon' with data.buckets: training "
            f"on mixed shapes reads clips by key, as latents precomputed at each clip's bucket "
            f"(`megatron-video precompute` with data.buckets) or as raw videos of a prepared "
            f"energon dataset encoded per CP rank (the procedural source has one fixed shape)"
        )
    if d.source == "energon" and not family.reads_raw_video:
        raise ValueError(
            f"data.source ('energon') with data.buckets encodes raw clips with a video VAE; "
            f"model.family {config.model.family!r} trains on none (use data.source 'shards')"
        )
    if t.sample:
        raise ValueError(
            "train.sample (True) is not supported with data.buckets (the end-of-run sample has "
            "one fixed shape); set train.sample: false"
        )
    if t.micro_batch_size != 1:
        raise ValueError(
            f"train.micro_batch_size ({t.micro_batch_size}) must be 1 with data.buckets (a packed "
            f"micro-batch is one sequence of data.buckets.tokens_per_microbatch tokens; set "
            f"train.global_batch_size for more micro-batches per step)"
        )
    if config.model.per_token_timesteps:
        raise ValueError(
            "model.per_token_timesteps (True) is not supported with data.buckets (packed clips "
            "take one timestep per clip); leave it false"
        )
    bucket_grid(config)  # the grid at the model's patch: ValueError naming data.buckets


def _model_fits_parallel(config: Config) -> None:
    """Heads, query groups and layers against the TP / Ulysses / PP degrees."""
    m, p = config.model, config.parallel
    TP, PP, U = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.ulysses_size
    H = m.num_attention_heads
    G = m.num_query_groups or H
    if G % TP:
        raise ValueError(
            f"model.num_query_groups ({G}) must be divisible by "
            f"parallel.tensor_model_parallel_size ({TP})"
        )
    if (H // TP) % U:
        raise ValueError(
            f"model.num_attention_heads ({H}) / parallel.tensor_model_parallel_size "
            f"({TP}) must be divisible by parallel.ulysses_size ({U}) (Ulysses "
            f"scatters heads)"
        )
    if m.num_layers % PP:
        raise ValueError(
            f"model.num_layers ({m.num_layers}) must be divisible by "
            f"parallel.pipeline_model_parallel_size ({PP})"
        )


# fields only some families read (FamilySpec.model_fields names them): refused where unread
FAMILY_MODEL_FIELDS = (
    "init_from",
    "hf_config",
    "per_token_timesteps",
    "data.i2v_probability",
    "data.text_encoder",
)


def _family_fields(config: Config, family) -> None:
    for name in FAMILY_MODEL_FIELDS:
        section, key = name.split(".") if "." in name else ("model", name)
        value = getattr(getattr(config, section), key)
        default = getattr(getattr(Config(), section), key)
        if value != default and name not in family.model_fields:
            raise ValueError(
                f"{section}.{key} ({value!r}) is not a field of model.family "
                f"{config.model.family!r} (it does not read it); leave it at "
                f"{default!r}"
            )


def vae_fits_data(config: Config) -> None:
    """``data.num_frames`` / ``height`` / ``width`` (pixels) and ``vae.latent_channels`` against
    the VAE (``vae_geometry``)."""
    d, g = config.data, vae_geometry(config)
    if g.latent_channels != config.vae.latent_channels:
        raise ValueError(
            f"vae.latent_channels ({config.vae.latent_channels}) must equal the VAE's latent "
            f"channels ({g.latent_channels}, {g.source}: z_dim)"
        )
    if (d.num_frames - 1) % g.temporal_stride:
        raise ValueError(
            f"data.num_frames ({d.num_frames}) must be 1 + {g.temporal_stride}k (the causal "
            f"VAE, {g.source}, maps frame 0 to latent 0 and {g.temporal_stride} frames to each "
            f"later latent)"
        )
    for name in ("height", "width"):
        val = getattr(d, name)
        if val % g.spatial_stride:
            raise ValueError(
                f"data.{name} ({val}) must be divisible by the VAE's spatial stride "
                f"{g.spatial_stride} ({g.source}; its downsampling x its patch "
                f"{g.patch_size}): data.{name} is the clip's pixel size"
            )


def _patch_fits_latents(config: Config) -> None:
    m, d = config.model, config.data
    F, h, w = latent_shape(config)
    pt, ph, pw = m.patch_size
    for axis, n, ps in (("frames", F, pt), ("height", h, ph), ("width", w, pw)):
        if n % ps:
            raise ValueError(
                f"model.patch_size ({list(m.patch_size)}) must divide the latent "
                f"{axis} ({n}, from data.num_frames={d.num_frames}, "
                f"height={d.height}, width={d.width})"
            )


def _global_batch_fits(config: Config, world_size: int) -> None:
    t = config.train
    dp = data_parallel_size(config, world_size)
    gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
    _pos_int("train.global_batch_size", gbs)
    if gbs % (t.micro_batch_size * dp):
        raise ValueError(
            f"train.global_batch_size ({gbs}) must be divisible by train.micro_batch_size "
            f"({t.micro_batch_size}) * data-parallel size ({dp})"
        )
