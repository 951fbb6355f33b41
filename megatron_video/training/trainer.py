"""The trainer on Megatron-Core alone: parallel state, DDP, optimizer, schedule, checkpoints, outputs.

``Trainer(config)`` builds one job on an initialised process group (``init_distributed``) and
``run()`` trains it; design in docs/architecture.md ("Megatron integration"), the numerics guard
and failure behaviour in docs/reliability.md.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from megatron_video.compat import (
    cpu_mode_active,
    cpu_optimizer_config_kwargs,
    destroy_model_parallel,
    ensure_cpu_mode,
    initialize_model_parallel,
)
from megatron_video.parallel import comm
from megatron_video.parallel.topology import destroy_video_parallel, init_video_parallel

from . import checkpoint as ckpt
from . import generate
from .batches import RankCoords, checked_step_batches, rank_data
from .batches.fixed import MicroBatch
from .config import Config, config_to_dict, validate
from .families import get_family
from .model_factory import build_model, wrap_data_parallel
from .vae_stage import ensure_vae, load_vae

__all__ = ["init_distributed", "Trainer", "train", "NonFiniteError"]


class NonFiniteError(RuntimeError):
    """A step's loss or gradient was not finite and ``train.nonfinite_policy`` says stop."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 1800.0) -> bool:
    """Initialise ``torch.distributed`` from the environment (NCCL on GPU, gloo on CPU); a lone
    process without ``RANK`` / ``WORLD_SIZE`` becomes a world of one on a free local port, leaving
    the environment as it was (a later ``--nproc`` launch from the same process must not look like
    torchrun). Returns whether it did."""
    if dist.is_initialized():
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if cuda else "gloo"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
    return True


def _to(mb: MicroBatch, device) -> MicroBatch:
    for name, value in vars(mb).items():
        if isinstance(value, torch.Tensor):
            setattr(mb, name, value.to(device))
    return mb


class Trainer:
    """One training job on an initialised process group.

    ``torch.distributed`` must be initialised (``init_distributed`` does it from the environment:
    torchrun, the ``--nproc`` launcher, or a single process). ``Trainer(config)`` then

    1. initialises Megatron's parallel state (TP, PP, CP = U*R with hierarchical groups [U, R],
       DP) and the U x R groups (``init_video_parallel``), seeds Megatron's RNG tracker;
    2. loads the cached VAE, builds the model of this pipeline stage, wraps it in Megatron's DDP
       (distributed optimizer on GPU only), Megatron's optimizer with gradient clipping and
       ``OptimizerParamScheduler``; ``finalize_model_grads`` reduces gradients over data x
       context parallel ranks, sums QK-norm gradients over TP and the conditioning embedders over
       stages;
    3. runs Megatron's forward-backward schedule (pipelined when PP > 1) per step; the schedule
       multiplies the objective's per-rank loss share by the CP size and DDP averages over
       DP x CP, i.e. the loss is summed over CP and averaged over DP.

    With ``data.buckets`` (mixed shapes) the micro-batches are packed sequences of clips
    (``batches.packed.PackedBatchMaker``: sample ledger, one placement plan per micro-batch, printed
    once on rank 0) and the objective is the family's ``make_packed_objective``; the ledger is
    the checkpoint's data state (``dataloader/ledger.json``).

    ``run()`` adds resume (under any parallel layout, ``checkpoint.py``), the tqdm bar (loss,
    tokens/s, step time), TensorBoard, periodic and final checkpoints, CP sampling, and
    ``metrics.json`` / ``loss.png`` / ``sample.gif`` in ``config.output``, written by the logging
    rank (the last global rank: a last-stage rank, where the loss is).

    Numerics guard: after each step's backward one all-reduce tells every rank whether any rank
    saw a non-finite loss or gradient; then the update is not applied and
    ``train.nonfinite_policy`` decides: ``skip`` counts the step (``skipped_total`` in the
    metrics) and continues, up to ``train.max_skipped_steps`` in a row; ``stop`` saves the state
    from before the step and raises ``NonFiniteError`` naming the step."""

    def __new__(cls, config: Config, *args, **kwargs):
        if cls is Trainer:  # a family may train with another step (video_llava's GRPO)
            cls = get_family(config.model.family).trainer_class(config) or cls
        return super().__new__(cls)

    def __init__(
        self,
        config: Config,
        progress: Optional[bool] = None,
        heartbeat: Optional[Callable[[int], None]] = None,
        cpu: bool = False,
    ):
        self._check_runtime(cpu)
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.has_gpu = torch.cuda.is_available()
        if config.parallel.auto:  # the planner picks the layout (pure: the same on every rank)
            config = self.config = self._auto_layout(config)
        validate(config, self.world, self.has_gpu)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.has_gpu
            else torch.device("cpu")
        )
        self.is_logger = self.rank == 0  # the console rank (launch.py); every rank has the loss
        self.heartbeat = heartbeat  # progress report to the launcher's watchdog (launch.py)
        self.progress = self.is_logger and (config.train.progress if progress is None else progress)

        self._init_parallel(config)

        self.family = get_family(config.model.family)
        # VAE (trained once and cached; under --nproc the launcher did it before spawning). Rank 0
        # trains it if needed; its success travels in an all-reduce so no rank waits for a failure.
        if self.family.needs_vae:
            self._load_vae(config)
        else:  # Wan: the diffusers VAE + text encoder of raw clips, or None (shards)
            self.vae_path, self.latent_scale = None, 1.0
            self.vae = self.family.raw_video_encoders(config)

        self.packed = config.data.buckets is not None  # mixed shapes: packed micro-batches
        data = rank_data(
            config,
            self.family,
            self.groups,
            self.coords,
            vae=self.vae,
            latent_scale=self.latent_scale,
            log=(lambda text: print(text, flush=True)) if self.is_logger else None,
        )
        self.batches, self.objective = data.batches, data.objective
        self.seq_length = data.seq_length
        self.layout, self.geometry = data.layout, data.geometry
        self.num_microbatches = self.batches.num_microbatches
        self.global_batch = self.num_microbatches * config.train.micro_batch_size * self.dp_size
        self._build()
        self._beat(-1)  # start-up done (the watchdog's clock restarts at every beat)

    def _auto_layout(self, config: Config) -> Config:
        """``parallel: auto``: the planner's best layout for this world size, printed once."""
        from .planning import auto_layout

        config, best = auto_layout(config, self.world)
        if self.rank == 0:
            print(
                f"[megatron-video] parallel: auto -> {best.layout.name()} (predicted step "
                f"{best.step_s:.3g} s, {best.mem_gib:.2f} GiB/GPU; docs/planner.md)",
                flush=True,
            )
        return config

    @staticmethod
    def _check_runtime(cpu: bool) -> None:
        """torch.distributed is initialised and there is CUDA or CPU mode (entered if ``cpu``)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_distributed() first"
            )
        if cpu:  # explicit: `megatron-video ... --cpu` (a no-op where CUDA is available)
            ensure_cpu_mode()
        if not torch.cuda.is_available() and not cpu_mode_active():
            raise RuntimeError(
                "no CUDA device: run on CPU with `megatron-video ... --cpu`, or call "
                "megatron_video.compat.ensure_cpu_mode() before the trainer "
                "(docs/architecture.md, 'CPU mode')"
            )

    def _init_parallel(self, config: Config) -> None:
        """Megatron's model-parallel state, the U x R video groups and this rank's place in them."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        p = config.parallel
        U, R = p.ulysses_size, p.ring_size
        kw = dict(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
        )
        if U > 1 and R > 1:
            kw["hierarchical_context_parallel_sizes"] = (
                [U, R] if p.placement == "ulysses_inner" else [R, U]
            )
        initialize_model_parallel(**kw)
        self.groups = init_video_parallel(
            U, R, ranks_per_node=p.ranks_per_node, placement=p.placement
        )
        model_parallel_cuda_manual_seed(config.train.seed)
        self.first_stage, self.last_stage = (
            ps.is_pipeline_first_stage(),
            ps.is_pipeline_last_stage(),
        )
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.cp_rank, self.cp_size = self.groups.cp_rank, self.groups.cp_size
        self.coords = RankCoords(
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            cp_rank=self.cp_rank,
            ulysses_size=U,
            ring_size=R,
            first_stage=self.first_stage,
            last_stage=self.last_stage,
        )

    def _load_vae(self, config: Config) -> None:
        failed, error = torch.zeros(1), None
        if self.rank == 0:
            try:
                ensure_vae(config, progress=config.train.progress)
            except Exception as e:  # re-raised below on rank 0, reported on the others
                failed[0], error = 1, e
        comm.all_reduce(failed, dist.group.WORLD, tag="vae.status")
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError("the VAE stage failed on rank 0 (see its error)")
        self.vae_path = ensure_vae(config, progress=False)
        self.vae, self.latent_scale = load_vae(self.vae_path, config)

    # -- construction ------------------------------------------------------------------------
    def _build(self) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func

        c, t = self.config, self.config.train
        self.tcfg = self.family.transformer_config(c, self.has_gpu)
        if c.parallel.pipeline_model_parallel_size > 1:
            # Megatron-LM's default: a stage's output is freed once sent (it must be viewless)
            self.tcfg.deallocate_pipeline_outputs = True
        torch.manual_seed(t.seed)  # CPU initialisation: the same full weights on every layout
        model = build_model(c, self.tcfg, self.first_stage, self.last_stage)
        if self.has_gpu:
            model.cuda()
        self._prepare_model(model)  # before DDP and the optimizer see its trainable parameters
        self.model = model  # unwrapped: checkpoints and parameter access
        if t.bf16:  # Megatron's mixed precision: bf16 module, fp32 inputs / outputs at its edges
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(self.tcfg, model)
        self.ddp = wrap_data_parallel(self.tcfg, model, c.parallel.fsdp, self.has_gpu)
        gpu = self.ddp.ddp_config.use_distributed_optimizer
        dtype = torch.bfloat16 if t.bf16 else torch.float32
        opt_cfg = OptimizerConfig(
            **cpu_optimizer_config_kwargs(
                optimizer="adam",
                lr=t.lr,
                min_lr=t.min_lr,
                weight_decay=t.weight_decay,
                adam_beta1=t.adam_beta1,
                adam_beta2=t.adam_beta2,
                clip_grad=t.clip_grad,
                bf16=t.bf16,
                params_dtype=dtype,
                use_distributed_optimizer=gpu,
            )
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.ddp])
        gbs = self.global_batch
        decay = max(t.steps, t.warmup_steps + 1)  # Megatron needs warmup < decay
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=t.lr,
            min_lr=t.min_lr,
            lr_warmup_steps=t.warmup_steps * gbs,
            lr_decay_steps=decay * gbs,
            lr_decay_style=t.lr_decay_style,
            start_wd=t.weight_decay,
            end_wd=t.weight_decay,
            wd_incr_steps=decay * gbs,
            wd_incr_style="constant",
            # on resume the schedule is the config's (Megatron-LM's --override-opt_param-scheduler),
            # counted from the checkpoint's step: a resumed run equals the uninterrupted one
            override_opt_param_scheduler=True,
            use_checkpoint_opt_param_scheduler=False,
        )
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        if t.bf16:
            self.tcfg.grad_scale_func = self.optimizer.scale_loss
        self.forward_backward_func = get_forward_backward_func()

    def _prepare_model(self, model) -> None:
        """Hook on the built model (``training.grpo``: the frozen encoder and the reference)."""

    # -- one step ----------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        mb = _to(next(data_iterator), self.device)
        args, kwargs = self.objective.model_call(mb, self.first_stage)
        output = model(*args, **kwargs)
        extra = ()
        if isinstance(output, tuple):  # (output, this rank's loss mask), as LLaVAModel returns
            output, *extra = output

        def loss_func(out):
            share = self.objective.loss(out, mb, *extra)
            value = share.detach().clone().float()
            comm.all_reduce(value, self.groups.cp_group, tag="loss.value")
            return share, {"loss": value}

        return output, loss_func

    def forward_backward(self, step: int) -> Optional[float]:
        """Gradients of step ``step`` (reduced; no optimizer step). Returns the loss on last-stage
        ranks (averaged over micro-batches and data-parallel ranks), None elsewhere."""
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward_func(
            forward_step_func=self._forward_step,
            data_iterator=checked_step_batches(self.batches, step),
            model=[self.ddp],
            num_microbatches=self.num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=self.config.train.micro_batch_size,
            forward_only=False,
        )
        if not self.last_stage:
            return None
        loss = torch.stack([d["loss"] for d in losses]).mean().reshape(1)
        comm.all_reduce(loss, self.dp_group, tag="loss.dp")
        return float(loss) / self.dp_size

    def train_step(self, step: int) -> Dict[str, float]:
        """One step. A non-finite loss or gradient on any rank is seen by every rank (one
        all-reduce) and the update is not applied: ``nonfinite`` is True in the record and the
        caller applies ``train.nonfinite_policy`` (see ``run``)."""
        finite, loss = self._all_finite(self.forward_backward(step))
        if not finite:
            self.optimizer.zero_grad()
            return {
                "loss": loss,
                "grad_norm": None,
                "lr": float(self.optimizer.param_groups[0]["lr"]),
                "skipped": True,
                "nonfinite": True,
            }
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=self.global_batch)
        return {
            "loss": loss,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "skipped": not ok,
            "nonfinite": False,
        }

    def _all_finite(self, loss: Optional[float]) -> Tuple[bool, float]:
        """Collective over all ranks: whether this step's loss (last stage) and reduced gradients
        are finite, and the loss itself on every rank (the last rank's, carried by the same
        all-reduce: the console rank 0 may be on another pipeline stage)."""
        verdict = torch.zeros(2, dtype=torch.float64, device=self.device)
        if loss is not None and not math.isfinite(loss):
            verdict[0] += 1
        if self.rank == self.world - 1:  # always a last-stage rank
            verdict[1] = loss
        # one reduction per gradient buffer (Megatron DDP keeps them contiguous), no host sync here
        expert = getattr(self.ddp, "expert_parallel_buffers", None)  # FSDP: no buffers
        buffers = [] if expert is None else self.ddp.buffers + expert
        grads = [b.grad_data for b in buffers] or [
            getattr(p, "main_grad", p.grad) for p in self.ddp.parameters()
        ]
        from ..parallel.fsdp import local_tensor

        for g in map(local_tensor, filter(None.__ne__, grads)):  # FSDP: this rank's shard
            if g.numel():
                verdict[0] += (~torch.isfinite(g)).any().to(verdict.dtype)
        dist.all_reduce(verdict)
        flag, loss = verdict.tolist()
        return flag == 0.0, loss

    # -- checkpoints -------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.config.output) / "checkpoints"

    @property
    def model_meta(self) -> Dict:
        """The configuration that fixes the model's shape (a resume must match it)."""
        meta = {f"model.{k}": v for k, v in config_to_dict(self.config)["model"].items()}
        meta["vae.latent_channels"] = self.config.vae.latent_channels
        return meta

    def _data_state(self, step: int):
        """``(file name, JSON)`` of the data state, or None: the sample ledger (the same on every
        rank, any DP size resumes from it) once, by rank 0; None where the batches are stateless
        (a pure function of the step)."""
        state = self.batches.data_state(step)
        return ("ledger", state) if state is not None and self.rank == 0 else None

    def save(self, step: int) -> Path:
        return ckpt.save_checkpoint(
            self.checkpoint_dir,
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            meta=self.model_meta,
            data_state=self._data_state(step),
            extra_files={
                **self.family.checkpoint_files(self.config, self.tcfg.params_dtype),
                **generate.config_file(self.config),  # what `megatron-video generate` builds
            },
        )

    def load(self, directory=None, step: Optional[int] = None) -> int:
        """Restore a checkpoint written under any parallel layout (see ``checkpoint.py``)."""
        directory = directory or self.checkpoint_dir
        step = ckpt.load_checkpoint(
            directory, self.model, self.optimizer, self.scheduler, step=step, meta=self.model_meta
        )
        if self.batches.data_state() is not None:  # the sample ledger: resume there
            reason = None
            try:
                self.batches.restore_data_state(ckpt.read_data_state(directory, step, "ledger"))
            except ValueError as e:
                reason = str(e)
            comm.agree_or_raise(
                reason, "data-loader resume refused"
            )  # every rank raises, none hangs
        return step

    def maybe_resume(self) -> int:
        if not self.config.train.resume or ckpt.latest_step(self.checkpoint_dir) is None:
            return 0
        step = self.load()
        if self.is_logger:
            path = ckpt.checkpoint_path(self.checkpoint_dir, step)
            print(f"[megatron-video] resumed from iteration {step} ({path})", flush=True)
        return step

    # -- the job -----------------------------------------------------------------------------
    def run(self) -> Dict:
        """Train ``config.train.steps`` steps (resuming if asked), save, sample, write outputs."""
        c, t = self.config, self.config.train
        out_dir = Path(c.output)
        if self.is_logger:
            out_dir.mkdir(parents=True, exist_ok=True)
        writer = None
        if self.is_logger and t.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out_dir / "tensorboard"))
        start = self.maybe_resume()
        self._beat(start - 1)
        history = self._previous_history(start, out_dir / "metrics.json")
        tokens_per_step = self.global_batch * self.seq_length
        bar = tqdm(
            total=t.steps,
            initial=start,
            desc=f"train {c.model.family}",
            disable=not self.progress,
            dynamic_ncols=True,
        )
        wall0 = time.time()
        last_saved = start if start else None
        skipped = skipped_run = 0
        for step in range(start, t.steps):
            self._beat(step)
            t0 = time.time()
            rec = self.train_step(step)
            dt = time.time() - t0
            if self.packed:  # this step's real tokens (the clips vary)
                tokens_per_step = self.batches.last_step_tokens
            rec.update(step=step, step_time=dt, tokens_per_s=tokens_per_step / dt)
            skipped_run = skipped_run + 1 if rec["nonfinite"] else 0
            skipped += int(rec["nonfinite"])
            rec["skipped_total"] = skipped
            if rec["nonfinite"]:
                self._nonfinite(step, rec, skipped_run, history, train_wall=time.time() - wall0)
            if self.is_logger:
                history.append(rec)
                self._log_step(rec, step, bar, writer)
            if t.save and t.save_interval and (step + 1) % t.save_interval == 0:
                self.save(step + 1)
                last_saved = step + 1
                self._beat(step)
        bar.close()
        train_wall = time.time() - wall0
        if t.save and t.steps > 0 and last_saved != t.steps:
            self.save(t.steps)
        self._beat(t.steps)
        sample, sample_wall = None, 0.0
        if t.sample:
            s0 = time.time()
            sample = generate.training_sample(self)
            sample_wall = time.time() - s0
            self._beat(t.steps)
        metrics: Dict = {}
        if self.is_logger:
            metrics = self._write_outputs(history, train_wall, sample_wall, sample, out_dir, writer)
        if writer is not None:
            writer.close()
        dist.barrier()
        return metrics

    def _previous_history(self, start: int, prev: Path) -> List[Dict]:
        """On resume, the logging rank keeps the curve of the interrupted run (steps < start)."""
        if not (start and self.is_logger and prev.is_file()):
            return []
        import json

        return [h for h in json.loads(prev.read_text()).get("history", []) if h["step"] < start]

    def _log_step(self, rec: Dict, step: int, bar, writer) -> None:
        """The logging rank's progress bar and, every ``train.log_interval`` steps, TensorBoard."""
        bar.update(1)
        bar.set_postfix(self._postfix(rec))
        if writer is not None and step % self.config.train.log_interval == 0:
            for k in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time", "skipped_total"):
                if rec.get(k) is not None:
                    writer.add_scalar(f"train/{k}", rec[k], step)

    def _postfix(self, rec: Dict) -> Dict[str, str]:
        return {
            "loss": f"{rec['loss']:.4f}",
            "tok_s": f"{rec['tokens_per_s']:.0f}",
            "step_s": f"{rec['step_time']:.2f}",
        }

    def _beat(self, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat(step)

    def _nonfinite(
        self, step: int, rec: Dict, skipped_run: int, history: List[Dict], train_wall: float
    ) -> None:
        """Apply ``train.nonfinite_policy`` after a step whose loss or gradients were not finite
        (the same decision on every rank). ``stop`` (or ``skip`` past ``train.max_skipped_steps``
        in a row) saves the weights from before the step, writes the metrics and raises."""
        t = self.config.train
        if t.nonfinite_policy == "skip" and skipped_run <= t.max_skipped_steps:
            return
        saved = None
        if t.save:
            saved = self.save(step)  # the update was not applied: this is the state before `step`
        if self.is_logger:
            history.append(rec)
            self._write_outputs(history, train_wall, 0.0, None, Path(self.config.output), None)
        why = (
            "train.nonfinite_policy is 'stop'"
            if t.nonfinite_policy == "stop"
            else f"{skipped_run} steps in a row were skipped (train.max_skipped_steps={t.max_skipped_steps})"
        )
        raise NonFiniteError(
            f"step {step}: non-finite loss or gradient (loss={rec['loss']}); {why}; "
            + (
                f"saved the state before this step to {saved}"
                if saved
                else "nothing saved (train.save is false)"
            )
        )

    def _write_outputs(self, history, train_wall, sample_wall, sample, out_dir, writer) -> Dict:
        from megatron_video.generation.video_out import write_gif

        from .outputs import plot_loss, write_metrics

        c, p = self.config, self.config.parallel
        losses = [h["loss"] for h in history]
        k = max(1, min(50, len(losses) // 10))  # loss means over the first / last k steps

        def mean(values):
            return sum(values) / len(values) if values else None

        metrics = {
            "family": c.model.family,
            "world_size": self.world,
            "vae": None if self.vae_path is None else str(self.vae_path),
            "parallel": {
                "tp": p.tensor_model_parallel_size,
                "pp": p.pipeline_model_parallel_size,
                "cp": self.cp_size,
                "ulysses": p.ulysses_size,
                "ring": p.ring_size,
                "dp": self.dp_size,
            },
            "steps": len(history),
            "global_batch": self.global_batch,
            "tokens_per_step": self.global_batch * self.seq_length,
            "train_wall_s": train_wall,
            "sample_wall_s": sample_wall,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "loss_mean_steps": k,
            "loss_first_mean": mean(losses[:k]),
            "loss_last_mean": mean(losses[-k:]),
            "tokens_per_s_mean": mean([h["tokens_per_s"] for h in history]),
            "nonfinite_steps": sum(1 for h in history if h.get("nonfinite")),
            "history": history,
            "config": config_to_dict(c),
        }
        if losses:
            plot_loss(
                out_dir / "loss.png",
                [h["step"] for h in history],
                losses,
                title=f"{c.model.family} (CP={self.cp_size}: U{p.ulysses_size} x R{p.ring_size})",
            )
        if isinstance(sample, dict):  # the Wan families: latents (generate.wan_training_sample)
            torch.save(sample["latents"], out_dir / "sample_latents.pt")
            metrics["sample"] = {
                "frames": sample["frames"],
                "latents": str(out_dir / "sample_latents.pt"),
            }
            if "video" in sample:  # decoded by vae.diffusers
                write_gif(out_dir / "sample.gif", [sample["video"][0]], labels=["generated"])
                metrics["sample"]["gif"] = str(out_dir / "sample.gif")
        elif sample is not None:
            generated, truth, recon, captions = sample
            write_gif(
                out_dir / "sample.gif",
                [truth[0], recon[0], generated[0]],
                labels=["data", "VAE recon", "generated"],
            )
            metrics["sample"] = {
                "caption": captions[0],
                "frames": int(generated.shape[2]),
                "gif": str(out_dir / "sample.gif"),
            }
            if writer is not None:  # frames of the generated video, left to right
                frames = ((generated[0].permute(1, 0, 2, 3) + 1) / 2).clamp(0, 1)  # [T, 3, H, W]
                writer.add_image("sample/generated", torch.cat(list(frames), dim=2), 0)
        write_metrics(out_dir / "metrics.json", metrics)
        return metrics

    def close(self) -> None:
        destroy_video_parallel()
        destroy_model_parallel()


def train(
    config: Config,
    progress: Optional[bool] = None,
    heartbeat: Optional[Callable[[int], None]] = None,
    cpu: bool = False,
) -> Dict:
    """Run a whole job in this process (one rank); initialises and tears down what it set up.
    Without a ``heartbeat`` (torchrun) the process group's timeout is ``train.rank_timeout_s``:
    a collective waiting that long on a dead or hung peer raises. With one, the launcher's watchdog
    ends the job after ``train.rank_timeout_s`` without progress and names the rank; the group's
    own timeout is then a backstop. ``cpu``: enter CPU mode first (``megatron_video.compat.ensure_cpu_mode``;
    a no-op on a GPU)."""
    timeout = config.train.rank_timeout_s
    owns = init_distributed(timeout if heartbeat is None else 2 * timeout + 60)
    trainer = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*scope is deprecated.*")
            trainer = Trainer(config, progress=progress, heartbeat=heartbeat, cpu=cpu)
            return trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        if owns and dist.is_initialized():
            dist.destroy_process_group()
