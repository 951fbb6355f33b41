"""What the Megatron-LM entries share: flags, config checks, providers and the ``pretrain()`` call.

``examples/pretrain_video_dit.py`` and ``examples/pretrain_video_llava.py`` are one
:class:`MegatronLMEntry` each; ``megatron.training`` is imported only when Megatron-LM runs, so
the providers import and test without it (docs/architecture.md, "Megatron integration").
"""

from __future__ import annotations

import argparse
import inspect
import sys
from functools import partial
from typing import Optional, Sequence

import torch

from .batches import RankCoords, checked_step_batches, rank_data
from .config import Config, load_config, validate
from .families import get_family
from .model_factory import build_model

__all__ = [
    "add_video_args",
    "sequence_length",
    "megatron_transformer_config",
    "PositionDataset",
    "HeldOutDataset",
    "train_valid_test_datasets_provider",
    "run_pretrain",
    "skip_shipped_helper_build",
    "MegatronLMEntry",
]


def add_video_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: the megatron-video flags."""
    g = parser.add_argument_group("megatron-video")
    g.add_argument(
        "--video-config", required=True, help="megatron-video YAML (examples/configs/*.yaml)"
    )
    g.add_argument(
        "--video-override",
        nargs="*",
        default=[],
        metavar="section.key=value",
        help="overrides of the YAML, as for megatron-video train",
    )
    g.add_argument(
        "--ulysses-size",
        type=int,
        default=None,
        help="Ulysses degree U (default: the first of --hierarchical-context-parallel-sizes, "
        "else the YAML's)",
    )
    g.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per node for the U x R placement check (default: LOCAL_WORLD_SIZE)",
    )
    g.add_argument(
        "--cpu",
        action="store_true",
        help="enter megatron_video's CPU mode for Megatron-Core (no CUDA; logged)",
    )
    return parser


def sequence_length(config: Config) -> int:
    """Tokens per sample that the model processes (Megatron-LM's ``--seq-length``); with
    ``data.buckets`` the packed micro-batch's budget, ``data.buckets.tokens_per_microbatch``."""
    if config.data.buckets is not None:
        from .config import bucket_grid

        return bucket_grid(config).config.tokens_per_microbatch
    return get_family(config.model.family).seq_length(config)


def megatron_transformer_config(args):
    """The ``TransformerConfig`` Megatron-LM builds from its command line (feature-detected home:
    ``megatron.training.arguments`` up to 0.17, ``megatron.training.argument_utils`` from 0.18)."""
    try:
        from megatron.training.argument_utils import core_transformer_config_from_args
    except ImportError:
        from megatron.training.arguments import core_transformer_config_from_args
    return core_transformer_config_from_args(args)


class PositionDataset(torch.utils.data.Dataset):
    """Sample positions; every rank turns them into its own micro-batch (the family's batches)."""

    def __init__(self, num_samples: int):
        self.num_samples = int(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        return {"position": torch.tensor(i, dtype=torch.int64)}


class HeldOutDataset(PositionDataset):
    """Positions past the training stream: sample ``offset + i`` (``offset`` = the training
    samples), so validation / test never re-measure a training sample (docs/launch.md)."""

    def __init__(self, num_samples: int, offset: int):
        super().__init__(num_samples)
        self.offset = int(offset)

    def __getitem__(self, i: int) -> dict:
        return {"position": torch.tensor(self.offset + i, dtype=torch.int64)}


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Megatron-LM dataset provider: positions into the family's sample stream. Training takes
    positions ``[0, n_train)``, validation the next ``n_valid``, test the ``n_test`` after those:
    three disjoint ranges (held-out split of one stream)."""
    train, valid, test = (int(n) for n in train_val_test_num_samples)
    return (
        PositionDataset(train),
        (HeldOutDataset(valid, train) if valid else None),
        (HeldOutDataset(test, train + valid) if test else None),
    )


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its own


def run_pretrain(
    pretrain,
    model_provider,
    forward_step,
    parse_and_validate_args=None,
    cfg_container_from_args=None,
) -> None:
    """Call ``pretrain`` with the signature it has (feature detection, no version numbers).

    Up to megatron-core 0.17 ``pretrain(provider, model_provider, model_type, forward_step,
    extra_args_provider=...)`` parses the command line itself; from 0.18 its first parameter is a
    config container that the caller builds with ``parse_and_validate_args`` and
    ``pretrain_cfg_container_from_args``, and ``model_provider`` is passed by keyword.
    """
    from megatron.core.enums import ModelType

    params = inspect.signature(pretrain).parameters
    if "cfg_container" not in params:
        pretrain(
            train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            extra_args_provider=add_video_args,
        )
        return
    args = parse_and_validate_args(extra_args_provider=add_video_args)
    pretrain(
        cfg_container_from_args(args),
        train_valid_test_datasets_provider,
        model_type=ModelType.encoder_or_decoder,
        forward_step_func=forward_step,
        model_provider=model_provider,
    )


class _Job:
    """What the providers share inside one process (built on first use, after Megatron-LM has
    initialised the parallel state): the config, the U x R groups, the batches and the objective --
    as the trainer builds them (``training.trainer.Trainer``)."""

    def __init__(self, config: Config):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_video.parallel.topology import get_video_parallel_groups, init_video_parallel

        p = config.parallel
        family = get_family(config.model.family)
        self.config = config
        self.groups = get_video_parallel_groups(check_initialized=False) or init_video_parallel(
            p.ulysses_size, p.ring_size, ranks_per_node=p.ranks_per_node, placement=p.placement
        )
        vae, scale = None, 1.0
        if family.needs_vae:
            from megatron_video.training.vae_stage import ensure_vae, load_vae

            vae, scale = load_vae(ensure_vae(config, progress=False), config)
        else:  # Wan: the diffusers VAE + text encoder of raw clips, or None (shards)
            vae = family.raw_video_encoders(config)
        self.first_stage = ps.is_pipeline_first_stage()
        coords = RankCoords(
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            cp_rank=self.groups.cp_rank,
            ulysses_size=p.ulysses_size,
            ring_size=p.ring_size,
            first_stage=self.first_stage,
            last_stage=ps.is_pipeline_last_stage(),
        )
        data = rank_data(
            config,
            family,
            self.groups,
            coords,
            vae=vae,
            latent_scale=scale,
            log=(lambda text: print(text, flush=True)) if dist.get_rank() == 0 else None,
        )
        self.objective = data.objective
        self.drawn = self.batches = None
        if hasattr(data.batches, "from_positions"):  # stateless (video_qa): Megatron's positions
            self.batches = data.batches
            return
        # the sample ledger's micro-batches (fixed or mixed shapes) for training, and a second
        # maker over the same clips, seeded data.seed + 1, for evaluation (the same draws at
        # every one)
        self.drawn, self.eval_drawn = data.batches, data.batches.held_out()
        self._mbs, self._at = None, None  # this step's micro-batches, (training?, iteration)
        # forward_step runs inside the schedule: a load failure is shared by the ranks of this
        # pipeline stage (DP x CP; TP ranks read the same clips), which reach it together; a
        # world-wide all-reduce there would wait on stages blocked in their pipeline receives
        # (torchrun stops the other stages when these raise)
        self._stage_group = ps.get_data_parallel_group(with_context_parallel=True)

    def ledger_micro_batch(self, iteration: int, training: bool):
        """The next micro-batch of training step ``iteration`` (the ledger replayed to it
        after a resume), or of the evaluation run at ``iteration`` (its draws from step 0)."""
        if self._at != (training, iteration):
            if training:
                self.drawn.replay_to(iteration)
                self._mbs = checked_step_batches(self.drawn, iteration, self._stage_group)
            else:
                self.eval_drawn.restart()
                self._mbs = None
            self._at = (training, iteration)
        mb = next(self._mbs, None) if self._mbs is not None else None
        if mb is None and not training:  # the next evaluation step's micro-batches
            maker = self.eval_drawn
            self._mbs = checked_step_batches(
                maker, maker.sampler.ledger.next_step, self._stage_group
            )
            mb = next(self._mbs, None)
        if mb is None:
            raise ValueError(
                f"iteration {iteration}: more micro-batches were asked for than the step has "
                f"({self.drawn.num_microbatches}); --global-batch-size must be the config's"
            )
        return mb


def _check_ledger_position(args, step: int) -> None:
    """The ledger is replayed to ``step`` with this run's global batch: a checkpoint whose
    consumed samples say another global batch was used would repeat or skip clips. Same args on
    every rank: all raise, before the step's first collective."""
    consumed = getattr(args, "consumed_train_samples", None)
    if consumed is not None and consumed != step * args.global_batch_size:
        raise ValueError(
            f"--global-batch-size ({args.global_batch_size}): the checkpoint of iteration {step} "
            f"consumed {consumed} samples, not {step} x {args.global_batch_size}; the sample "
            "ledger replays with one global batch size: resume with the one it was saved with"
        )


def _loss_func(job: _Job, mb, extra, output_tensor):
    from megatron_video.parallel import comm

    share = job.objective.loss(output_tensor, mb, *extra)
    value = share.detach().clone().float()
    comm.all_reduce(value, job.groups.cp_group, tag="loss.value")
    # Megatron's schedule multiplies by the CP size; DDP averages over DP x CP: the CP shares sum.
    # Logged as (sum, count): Megatron sums both over DP x CP and divides, so the printed loss is
    # the mean over the step's micro-batches at every DP size (a bare value is one DP rank's)
    return share, {"loss": torch.stack([value.reshape(()), torch.ones_like(value).reshape(())])}


def _give_pg_collection(model, pg_collection) -> None:
    """Megatron's own models carry ``model.pg_collection`` (``training.py`` reads it in
    ``train_step``); give ours the one ``get_model`` passed, else Megatron's global groups.
    Feature-detected: releases without ``ProcessGroupCollection`` read no such attribute."""
    if getattr(model, "pg_collection", None) is not None:
        return
    if pg_collection is None:
        try:
            from megatron.core.process_groups_config import ProcessGroupCollection
        except ImportError:
            return
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model.pg_collection = pg_collection


def skip_shipped_helper_build() -> bool:
    """Megatron bug worked around for every user (GPU too): ``initialize.py`` has rank 0 run
    ``megatron.core.datasets.utils.compile_helpers`` (``make -C core/datasets``) even when the
    wheel ships the built ``helpers_cpp`` and no Makefile, and ``make`` fails (``sys.exit(1)``).
    Where the shipped helper imports and no Makefile is there, the build is replaced by that
    import; a source checkout (Makefile present) still builds. Returns whether it was replaced."""
    import importlib
    import os

    try:
        utils = importlib.import_module("megatron.core.datasets.utils")
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    folder = os.path.dirname(os.path.abspath(utils.__file__))
    if not hasattr(utils, "compile_helpers") or os.path.exists(os.path.join(folder, "Makefile")):
        return False

    def compile_helpers():
        """megatron_video: the wheel ships helpers_cpp built; nothing to compile."""

    utils.compile_helpers = compile_helpers
    return True


class MegatronLMEntry:
    """The providers of one Megatron-LM entry script, for the families in ``families``.

    The model, sequence layout, data and objective are those of ``megatron-video train`` (every
    choice is the family's, ``training.families``); the parallel sizes, batch sizes, seed,
    precision and sequence length come from Megatron-LM's flags and must agree with the YAML
    (``ValueError`` naming the flag).

    The script exposes the bound methods as its module-level providers; the job (config, groups,
    batches, objective) is per entry object, built on first use."""

    def __init__(self, script: str, families: Sequence[str]):
        self.script, self.families = script, tuple(families)
        self._job: Optional[_Job] = None

    # -- configuration -----------------------------------------------------------------------
    def video_config_from_args(self, args, world_size: Optional[int] = None) -> Config:
        """The YAML + overrides, with parallel sizes, batch sizes, seed and precision from
        Megatron-LM's args. Raises ``ValueError`` naming the flag when the YAML and Megatron-LM
        disagree."""
        cfg = load_config(args.video_config, list(args.video_override or []))
        if cfg.model.family not in self.families:
            raise ValueError(
                f"--video-config ({args.video_config}): model.family "
                f"({cfg.model.family!r}) must be one of {self.families} for {self.script}"
            )
        cp = int(getattr(args, "context_parallel_size", 1) or 1)
        hier = getattr(args, "hierarchical_context_parallel_sizes", None)
        U = args.ulysses_size or (
            hier[0]
            if hier
            else (cfg.parallel.ulysses_size if cfg.parallel.context_parallel_size == cp else cp)
        )
        if cp % U:
            raise ValueError(f"--ulysses-size ({U}) must divide --context-parallel-size ({cp})")
        p = cfg.parallel
        p.tensor_model_parallel_size = int(args.tensor_model_parallel_size)
        p.pipeline_model_parallel_size = int(args.pipeline_model_parallel_size)
        p.context_parallel_size, p.ulysses_size, p.ring_size = cp, U, cp // U
        import os

        rpn = args.ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE")  # as --ranks-per-node says
        if rpn is not None:
            p.ranks_per_node = int(rpn)
        m = cfg.model
        for flag, ours, theirs in (
            ("--num-layers", m.num_layers, getattr(args, "num_layers", None)),
            ("--hidden-size", m.hidden_size, getattr(args, "hidden_size", None)),
            (
                "--num-attention-heads",
                m.num_attention_heads,
                getattr(args, "num_attention_heads", None),
            ),
        ):
            if theirs is not None and theirs != ours:
                raise ValueError(f"{flag} ({theirs}) must equal the video config's value ({ours})")
        t = cfg.train
        t.micro_batch_size = int(args.micro_batch_size)
        t.global_batch_size = getattr(args, "global_batch_size", None)
        if getattr(args, "rampup_batch_size", None):
            raise ValueError(
                f"--rampup-batch-size ({args.rampup_batch_size}) is not supported: each step's "
                "clips come from the sample ledger, which takes one global batch size"
            )
        if t.objective != "supervised":
            raise ValueError(
                f"train.objective ({t.objective!r}) runs in `megatron-video train` (GRPO: "
                f"training/grpo.py); the Megatron-LM entry trains supervised"
            )
        t.seed = int(getattr(args, "seed", t.seed))
        t.bf16 = bool(getattr(args, "bf16", False))  # precision is Megatron-LM's (--bf16)
        t.sample = False  # Megatron-LM runs no sampling at the end
        seq = getattr(args, "seq_length", None)
        if seq is not None and seq != sequence_length(cfg):
            raise ValueError(
                f"--seq-length ({seq}) must be the model's tokens per sample "
                f"({sequence_length(cfg)})"
            )
        get_family(m.family).check_megatron_lm_args(cfg, args)
        if world_size is not None:
            validate(cfg, world_size, torch.cuda.is_available())
        return cfg

    def job(self, config: Optional[Config] = None) -> _Job:
        if self._job is None:
            if config is None:
                import torch.distributed as dist
                from megatron.training import get_args

                config = self.video_config_from_args(get_args(), dist.get_world_size())
            self._job = _Job(config)
        return self._job

    # -- providers ---------------------------------------------------------------------------
    def model_provider(
        self,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage=None,
        config=None,
        pg_collection=None,
        video_config: Optional[Config] = None,
        **unused,
    ):
        """Megatron-LM ``model_provider``: the model of this pipeline stage.

        ``config``: the ``TransformerConfig`` from Megatron-LM (``get_model`` passes it where it
        has one); otherwise it is built from Megatron-LM's arguments. The family adds only its own
        fields (``FamilySpec.megatron_lm_config``). ``video_config`` replaces the one read from
        ``--video-config`` (tests)."""
        job = self.job(video_config)
        if config is None:
            from megatron.training import get_args

            config = megatron_transformer_config(get_args())
        tcfg = get_family(job.config.model.family).megatron_lm_config(config, job.config)
        model = build_model(job.config, tcfg, pre_process, post_process, vp_stage)
        _give_pg_collection(model, pg_collection)
        if not torch.cuda.is_available():
            from megatron_video.compat import cpu_mode_active

            if cpu_mode_active():  # get_model calls model.cuda(current_device()): stay on the CPU
                model.cuda = lambda *a, **k: model
        return model

    def forward_step(self, data_iterator, model, step: Optional[int] = None):
        """Megatron-LM ``forward_step``: this rank's micro-batch through the model. A model that
        returns ``(output, loss_mask)`` (LLaVA) has the mask passed to the loss."""
        job = self.job()
        if step is None:
            from megatron.training import get_args

            margs = get_args()
            step = int(getattr(margs, "curr_iteration", 0))
            if job.drawn is not None and model.training:
                _check_ledger_position(margs, step)
        batch = next(data_iterator)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
        if job.drawn is not None:  # Megatron's positions only count; the ledger picks clips
            mb = job.ledger_micro_batch(step, model.training)
        else:
            mb = job.batches.from_positions([int(p) for p in batch["position"]], step)
        for name, value in vars(mb).items():
            if isinstance(value, torch.Tensor):
                setattr(mb, name, value.to(device))
        args, kwargs = job.objective.model_call(mb, job.first_stage)
        output, extra = model(*args, **kwargs), ()
        if isinstance(output, tuple):
            output, *extra = output
        return output, partial(_loss_func, job, mb, tuple(extra))

    def run_pretrain(self, pretrain, parse_and_validate_args=None, cfg_container_from_args=None):
        """``run_pretrain`` with this entry's providers."""
        run_pretrain(
            pretrain,
            self.model_provider,
            self.forward_step,
            parse_and_validate_args,
            cfg_container_from_args,
        )

    def main(self) -> None:
        if "--plan" in sys.argv:  # print the planner's flags, start nothing (docs/planner.md)
            from .planning import plan_entry

            sys.exit(plan_entry(sys.argv[1:], self.script))
        from megatron.training import pretrain

        if "--cpu" in sys.argv:  # before Megatron-LM initialises anything
            from megatron_video.compat import ensure_cpu_mode

            ensure_cpu_mode()
        skip_shipped_helper_build()
        parse = container = None
        if "cfg_container" in inspect.signature(pretrain).parameters:
            from megatron.training.argument_utils import (
                pretrain_cfg_container_from_args as container,
            )
            from megatron.training.arguments import parse_and_validate_args as parse
        self.run_pretrain(pretrain, parse, container)
