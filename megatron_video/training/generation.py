"""Generation from a trained model: what ``train.sample`` and ``megatron-video generate`` call.

T2V families (``video_dit``, ``stdit``): the context-parallel samplers of ``generation.cp_sampling``
(noise partitioned with the model's layout, denoised in parallel, gathered). AR families
(``ar_dit``, ``wan_ar``): the streaming generator with a KV cache (``generation.streaming``), block by
block, any length, sink + rolling window, prompt switches. ``generate`` loads a checkpoint of the
trainer (its ``video_config.json`` fixes the model), streams the blocks and VAE-decodes each finished
block into an mp4 and a GIF. Design: docs/generation.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch

from megatron_video.models.vae import TEMPORAL_STRIDE

from .batches.fixed import sample_generator
from .config import Config, config_from_dict, config_to_dict, latent_shape, token_grid_of
from .ti2v import i2v_probability_of

__all__ = [
    "CONFIG_FILE",
    "Generator",
    "caption_conditions",
    "parse_switch",
    "raw_frames_to_latent",
    "generate",
]

CONFIG_FILE = "video_config.json"  # the whole config, in every checkpoint of the trainer


def config_file(config: Config) -> dict:
    """``{CONFIG_FILE: json}``: what a checkpoint carries so ``generate`` can rebuild the model."""
    return {CONFIG_FILE: json.dumps(config_to_dict(config))}


def caption_conditions(config: Config, captions: Sequence[str], device) -> Tuple[tuple, tuple]:
    """``(cond, null)`` of the caption families: ``(ids, mask, drop)``; CFG drops the caption."""
    from megatron_video.data.synthetic import CaptionTokenizer

    tok = CaptionTokenizer(config.data.caption_len)
    ids, mask = zip(*(tok.encode(c) for c in captions))
    ids, mask = torch.stack(ids).to(device), torch.stack(mask).to(device)
    b = len(captions)
    cond = (ids, mask, torch.zeros(b, dtype=torch.bool, device=device))
    return cond, (ids, mask, torch.ones(b, dtype=torch.bool, device=device))


def raw_frames_to_latent(frames: int, frames_per_block: int, option: str = "--frames") -> int:
    """Latent frames of a video of ``frames`` raw frames (causal VAE: ``1 + 4 (F - 1)``), a whole
    number of AR blocks; ``ValueError`` naming ``option`` otherwise."""
    F, rest = divmod(frames - 1, TEMPORAL_STRIDE)
    F += 1
    if not isinstance(frames, int) or frames < 1 or rest or F % frames_per_block:
        step = TEMPORAL_STRIDE * frames_per_block
        raise ValueError(
            f"{option} ({frames}) must be 1 + {TEMPORAL_STRIDE} (F - 1) raw frames with F latent "
            f"frames a whole number of blocks of {frames_per_block} (e.g. "
            f"{1 + TEMPORAL_STRIDE * (frames_per_block - 1)}, "
            f"{1 + TEMPORAL_STRIDE * (frames_per_block - 1) + step}, ...)"
        )
    return F


def parse_switch(text: str) -> Tuple[int, str]:
    """``"FRAME:PROMPT"`` of ``--switch`` -> ``(raw frame, prompt)``."""
    frame, sep, prompt = text.partition(":")
    if not sep or not frame.strip().isdigit() or not prompt.strip():
        raise ValueError(f"--switch ({text!r}) must be FRAME:PROMPT with FRAME a raw frame index")
    return int(frame), prompt.strip()


@dataclass
class Generator:
    """A model on its ranks, ready to sample: ``model`` (eval, no grad; any Megatron wrapper),
    ``config``, ``groups`` (``VideoParallelGroups``; CP rank and size), ``geometry`` /
    ``layout`` of the trained sample, ``token_ids`` this rank's T2V token ids, ``progress``."""

    model: Any
    config: Config
    family: Any
    groups: Any
    geometry: Any = None
    layout: Any = None
    token_ids: Optional[torch.Tensor] = None
    progress: bool = False
    placed: Any = None  # batches.placed: (PackedVideo of one clip, its PlacementPlan, local ids)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def t2v_tokens(self, cond, null, noise: torch.Tensor) -> torch.Tensor:
        """Full clean tokens ``[b, N, C]`` of a T2V family from the full ``noise`` (collective)."""
        from megatron_video.generation import cp_sampling as cps
        from megatron_video.generation.ar_models import WAN_TIMESTEP_SCALE, is_wan
        from megatron_video.generation.wan_sampling import _proj_out_to_patchify

        df, geo, model = self.config.diffusion, self.geometry, self.model
        guided = dict(
            null_cond=null,
            guidance_scale=df.guidance_scale,
            num_steps=df.sample_steps,
            progress=self.progress,
        )

        def net(x, tt, c):
            if self.placed is not None:
                return self._placed_net(x, tt, c)
            if is_wan(model):  # Wan's contiguous CP split, timestep t * 1000
                out = model(x, tt * WAN_TIMESTEP_SCALE, c[0], geo)
                z = self.config.vae.latent_channels
                return _proj_out_to_patchify(out, tuple(self.config.model.patch_size), z)
            return model(x, tt, c[0], c[1], geo, drop=c[2])

        if self.placed is not None:
            return self._placed_tokens(cps, net, noise, cond, guided)
        local = cps.partition_tokens(noise, self.token_ids)
        if self.config.diffusion.objective == "edm":
            out = cps.sample_edm(
                net, local, cond, sigma_data=df.sigma_data, sampler=df.sampler, **guided
            )
        else:
            out = cps.sample_flow(net, local, cond, shift=df.flow_shift, **guided)
        return cps.gather_tokens(out, self.token_ids, self.groups.cp_group, noise.shape[1])

    def _placed_net(self, x, tt, c):
        """The model on a token-placed batch (``batches.placed``): each sample its own packed
        sequence of one clip (padding attends nothing and is dropped after the gather)."""
        from megatron_video.generation.ar_models import WAN_TIMESTEP_SCALE, is_wan
        from megatron_video.generation.wan_sampling import _proj_out_to_patchify

        packed, plan, _ = self.placed
        B, model = x.shape[0], self.model
        tt = tt.reshape(-1).expand(B)
        outs = []
        for j in range(B):  # one collective model call per sample, the same count on every rank
            cj = [t[j : j + 1] for t in c]
            if is_wan(model):
                out = model(
                    x[j : j + 1], tt[j : j + 1] * WAN_TIMESTEP_SCALE, cj[0], packed,
                    placement=plan.placement,
                )  # fmt: skip
                z = self.config.vae.latent_channels
                out = _proj_out_to_patchify(out, tuple(self.config.model.patch_size), z)
            else:
                out = model(
                    x[j : j + 1], tt[j : j + 1], cj[0], cj[1], packed, drop=cj[2],
                    placement=plan.placement,
                )  # fmt: skip
            outs.append(out)
        return torch.cat(outs)

    def _placed_tokens(self, cps, net, noise, cond, guided):
        """``t2v_tokens`` of a token-placed batch: noise padded to the packed length, this
        rank's ids sampled, gathered, padding dropped."""
        packed, _, local = self.placed
        df, N = self.config.diffusion, noise.shape[1]
        pad = noise.new_zeros(noise.shape[0], packed.seq_len - N, noise.shape[2])
        x = cps.partition_tokens(torch.cat([noise, pad], dim=1), local)
        if df.objective == "edm":
            out = cps.sample_edm(
                net, x, cond, sigma_data=df.sigma_data, sampler=df.sampler, **guided
            )
        else:
            out = cps.sample_flow(net, x, cond, shift=df.flow_shift, **guided)
        return cps.gather_tokens(out, local, self.groups.cp_group, packed.seq_len)[:, :N]

    def ar_blocks(
        self,
        cond,
        null,
        noise_block,
        num_blocks: int,
        *,
        sink: int = 0,
        window: Optional[int] = None,
        switches: Sequence[Tuple[int, Any]] = (),
        first_frame: Optional[torch.Tensor] = None,
        recache: str = "block_causal",
    ) -> Iterator[Tuple[int, torch.Tensor, Any]]:
        """``stream_autoregressive`` with the model: ``(j, block tokens [b, nb*S, C], cache)``.
        ``window`` default: the trained latent frames less one block (the longest context the
        model saw), so a video of the trained length equals the recompute sampler. ``recache``:
        the prompt-switch KV re-cache, ``"block_causal"`` (ours) or ``"longlive"`` (LongLive
        v1.0's, its ``local_attn_size`` being ``sink + window + frames_per_block``)."""
        from megatron_video.generation.ar_models import block_model
        from megatron_video.generation.streaming import WindowRule, stream_autoregressive

        c, df = self.config, self.config.diffusion
        nb = c.model.frames_per_block
        _, Hp, Wp = token_grid_of(c)
        if window is None:
            window = latent_shape(c)[0] - nb
        g = self.groups
        N, rank = (1, 0) if g is None else (g.cp_size, g.cp_rank)
        return stream_autoregressive(
            block_model(self.model, Hp, Wp, nb, rank, N),
            noise_block,
            num_blocks,
            nb,
            Hp * Wp,
            cond,
            groups=g,
            null_cond=null,
            guidance_scale=df.guidance_scale,
            num_steps=df.sample_steps,
            shift=df.flow_shift,
            rule=WindowRule(nb, sink, window),
            switches=switches,
            first_frame=first_frame,
            recache=recache,
            progress=self.progress,
        )

    def sample_tokens(self, cond, null, seed: int, num_samples: int) -> torch.Tensor:
        """Full clean tokens ``[b, N, C]`` of the trained sample shape (``train.sample``): the
        noise of sample ``i`` drawn from ``sample_generator(seed, 10**9, i)``."""
        c = self.config
        T, Hp, Wp = token_grid_of(c)
        C = c.vae.latent_channels * int(torch.tensor(c.model.patch_size).prod())
        N = T * Hp * Wp
        noise = torch.stack(
            [
                torch.randn(N, C, generator=sample_generator(seed, 10**9, i))
                for i in range(num_samples)
            ]
        ).to(self.device)
        with torch.no_grad():
            if not self.family.autoregressive:
                return self.t2v_tokens(cond, null, noise)
            nbS = c.model.frames_per_block * Hp * Wp
            blocks = self.ar_blocks(
                cond, null, lambda j: noise[:, j * nbS : (j + 1) * nbS], N // nbS
            )
            return torch.cat([block for _, block, _ in blocks], dim=1)


def trainer_generator(trainer) -> Generator:
    """The ``Generator`` of a ``Trainer``'s model, groups and sample layout."""
    return Generator(
        model=trainer.ddp,
        config=trainer.config,
        family=trainer.family,
        groups=trainer.groups,
        geometry=trainer.geometry,
        layout=trainer.layout,
        token_ids=trainer.batches.token_ids,
        progress=trainer.progress,
        placed=trainer.batches.placed(1) if hasattr(trainer.batches, "placed") else None,
    )


def sample_tokens(trainer, num_samples: int) -> torch.Tensor:
    """The full clean tokens ``[b, N, C]`` of ``train.sample``'s held-out captions (collective)."""
    c = trainer.config
    items = _held_out(c, num_samples)
    cond, null = caption_conditions(c, [it["caption"] for it in items], trainer.device)
    trainer.ddp.eval()
    try:
        return trainer_generator(trainer).sample_tokens(cond, null, c.train.seed, num_samples)
    finally:
        trainer.ddp.train()


def _held_out(config: Config, b: int):
    from megatron_video.data.synthetic import ProceduralVideoDataset

    d = config.data
    held_out = ProceduralVideoDataset(
        b,
        num_frames=d.num_frames,
        height=d.height,
        width=d.width,
        seed=d.seed + 1_000_003,
        caption_len=d.caption_len,
    )
    return [held_out[i] for i in range(b)]


def wan_training_sample(trainer, num_samples: int):
    """``train.sample`` of the Wan families: the captions of the first held-out micro-batch (UMT5
    embeddings: precomputed, or by ``data.text_encoder`` for raw clips), generated (CFG against empty text)
    into latents ``{"latents": [b, C, F, h, w], "frames": F}`` on the logging rank, with
    ``"video" [b, 3, T, H, W]`` decoded by ``vae.diffusers`` when the config names one; None
    elsewhere (collective)."""
    from megatron_video.models.embedders import unpatchify

    c = trainer.config
    mb = next(iter(trainer.batches.held_out().step_batches(0)))
    text = (mb.caption_ids * mb.caption_mask.to(mb.caption_ids.dtype)[..., None])[:num_samples]
    text = text.to(trainer.device)
    b = text.shape[0]
    trainer.ddp.eval()
    try:
        full = trainer_generator(trainer).sample_tokens(
            (text,), (torch.zeros_like(text),), c.train.seed, b
        )
    finally:
        trainer.ddp.train()
    if not trainer.is_logger:
        return None
    g = trainer.geometry
    latents = unpatchify(
        full.cpu(), tuple(c.model.patch_size), (g.frames, g.height, g.width), c.vae.latent_channels
    )
    out = {"latents": latents, "frames": int(latents.shape[2])}
    if c.vae.diffusers:
        from .generation_wan import wan_vae_decoder

        out["video"] = wan_vae_decoder(c.vae.diffusers, c)(latents).float()
    return out


def training_sample(trainer, num_samples: Optional[int] = None):
    """``train.sample``: held-out captions generated and VAE-decoded: ``(generated, data, VAE
    reconstruction, captions)`` videos on the logging rank, None elsewhere (collective); the
    Wan families: ``wan_training_sample``."""
    from megatron_video.generation import cp_sampling as cps
    from megatron_video.models.embedders import patchify

    c = trainer.config
    b = num_samples or c.train.sample_batch
    if not trainer.family.needs_vae:
        return wan_training_sample(trainer, b)
    items = _held_out(c, b)
    full = sample_tokens(trainer, b)
    if not trainer.is_logger:
        return None
    patch = tuple(c.model.patch_size)
    grid = (trainer.geometry.frames, trainer.geometry.height, trainer.geometry.width)
    z = c.vae.latent_channels
    generated = cps.decode_tokens(trainer.vae, full.cpu(), patch, grid, z, trainer.latent_scale)
    truth = torch.stack([it["video"] for it in items])
    with torch.no_grad():
        recon_tokens = patchify(trainer.vae.encode(truth) * trainer.latent_scale, patch)
    recon = cps.decode_tokens(trainer.vae, recon_tokens, patch, grid, z, trainer.latent_scale)
    return generated, truth, recon, [it["caption"] for it in items]


# ----------------------------------------------------------------------------------------------
# megatron-video generate
# ----------------------------------------------------------------------------------------------
def read_checkpoint_config(checkpoint) -> Tuple[Config, Path, int]:
    """``(config, checkpoints folder, step)`` of a trainer run folder or its ``checkpoints``."""
    from . import checkpoint as ckpt

    folder = Path(checkpoint)
    if (folder / "checkpoints").is_dir():
        folder = folder / "checkpoints"
    step = ckpt.latest_step(folder)
    if step is None:
        raise ValueError(
            f"--checkpoint ({str(checkpoint)!r}) must be a run folder or its checkpoints folder "
            f"with a complete checkpoint of `megatron-video train`"
        )
    f = ckpt.checkpoint_path(folder, step) / CONFIG_FILE
    if not f.is_file():
        raise ValueError(
            f"--checkpoint ({str(checkpoint)!r}): {f} is missing (a checkpoint of an older "
            f"trainer); it names the model to build"
        )
    return config_from_dict(json.loads(f.read_text())), folder, step


def _project_decoder(config: Config):
    """``decode(latents [B, z, F, h, w]) -> video`` of the project's VAE (``ar_dit``)."""
    from .vae_stage import ensure_vae, load_vae

    vae, scale = load_vae(ensure_vae(config, progress=False), config)

    def decode(latents):
        with torch.no_grad():
            dt = next(vae.parameters()).dtype
            return vae.decode((latents / scale).to(dt)).clamp(-1.0, 1.0)

    return decode


class _VideoSink:
    """The logging rank's output: each finished block VAE-decoded (given all latents before it:
    the causal decoder's frames depend on them) and appended to an mp4 (libx264); a GIF at the
    end, captioned with the prompt in force at each frame (``switches``: ``(raw frame, prompt)``).
    ``decode(latents [1, z, F, h, w]) -> video [1, 3, T, H, W]`` in ``[-1, 1]``.
    ``add(j, block tokens)``; ``close() -> (mp4, gif, frames written, captions, tokens)``."""

    def __init__(self, output: str, config: Config, decode, prompt: str, switches=(), fps=8):
        import av

        self.out, self.config, self.decode, self.prompt = Path(output), config, decode, prompt
        self.switches = sorted(switches)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tokens, self.frames = [], []
        self._c = av.open(str(self.out.with_suffix(".mp4")), "w")
        self._st = self._c.add_stream("libx264", rate=fps)
        self._st.pix_fmt = "yuv420p"

    def add(self, j: int, block: torch.Tensor) -> None:
        import av

        from megatron_video.models.embedders import unpatchify

        c, nb = self.config, self.config.model.frames_per_block
        _, Hp, Wp = token_grid_of(c)
        self.tokens.append(block.cpu())
        grid = ((j + 1) * nb, Hp, Wp)
        patch, z = tuple(c.model.patch_size), c.vae.latent_channels
        video = self.decode(unpatchify(torch.cat(self.tokens, dim=1), patch, grid, z))[0]
        video = video[:, 0 if j == 0 else 1 + TEMPORAL_STRIDE * (j * nb - 1) :]
        if j == 0:
            self._st.height, self._st.width = video.shape[-2:]
        v = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        for t in range(v.shape[1]):
            self.frames.append(video[:, t])
            img = v[:, t].permute(1, 2, 0).contiguous().numpy()
            for pkt in self._st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                self._c.mux(pkt)

    def close(self) -> dict:
        from .outputs import write_gif

        for pkt in self._st.encode():
            self._c.mux(pkt)
        self._c.close()
        gif = self.out.with_suffix(".gif")
        captions = [
            ([self.prompt] + [p for f, p in self.switches if f <= t])[-1]
            for t in range(len(self.frames))
        ]
        write_gif(gif, [torch.stack(self.frames, dim=1)], labels=[captions])
        return dict(
            mp4=str(self.out.with_suffix(".mp4")),
            gif=str(gif),
            written_frames=len(self.frames),
            captions=captions,
            tokens=torch.cat(self.tokens, dim=1),
        )


def _check_window(nb: int, sink, window) -> None:
    """``--sink`` / ``--window``: whole blocks (``streaming.WindowRule``'s rule, named as the
    options), checked before the model is built."""
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0 or sink % nb:
        raise ValueError(
            f"--sink ({sink!r}) must be a non-negative multiple of model.frames_per_block ({nb}) "
            f"latent frames (the sink is whole blocks)"
        )
    bad = isinstance(window, bool) or not isinstance(window, int) or window < 0 or window % nb
    if window is not None and bad:
        raise ValueError(
            f"--window ({window!r}) must be a non-negative multiple of model.frames_per_block "
            f"({nb}) latent frames (the window is whole blocks), or unset (the trained length)"
        )


def _check_request(
    config: Config, family, frames: int, switches, image, sink=0, window=None, recache=None
) -> Tuple[int, list]:
    from megatron_video.generation.streaming import RECACHE

    nb = config.model.frames_per_block
    if recache is not None and recache not in RECACHE:
        raise ValueError(f"--recache ({recache!r}) must be one of {', '.join(RECACHE)}")
    if not family.autoregressive:
        raise ValueError(
            f"model.family ({config.model.family!r}) is not autoregressive: `megatron-video "
            f"generate` streams the AR families (ar_dit, wan_ar); T2V families sample with "
            f"train.sample"
        )
    if image is not None and "data.i2v_probability" not in family.model_fields:
        raise ValueError(
            f"--image ({image!r}): model.family {config.model.family!r} has no first-frame "
            f"conditioning (TI2V: wan_ar trained with data.i2v_probability > 0)"
        )
    if image is not None and i2v_probability_of(config) == 0:
        raise ValueError(
            f"--image ({image!r}): the checkpoint was trained without first-frame conditioning "
            f"(data.i2v_probability 0; Wan 2.2's 48-channel latents default to 0.5)"
        )
    F = raw_frames_to_latent(frames, nb)
    _check_window(nb, sink, window)
    out = []
    for raw, prompt in switches:
        lat, rest = divmod(raw - 1, TEMPORAL_STRIDE)
        if raw < 1 or rest or (lat + 1) % nb or not 0 < lat + 1 < F:
            raise ValueError(
                f"--switch ({raw}:...) frame must be a raw frame that starts a block inside the "
                f"video: 1 + {TEMPORAL_STRIDE} k with latent frame k a positive multiple of "
                f"{nb} below {F} (--frames {frames})"
            )
        out.append((lat + 1, prompt))
    return F, out


def _conditions(config: Config, family, prompts, image, text_encoder, vae):
    """``(conds of the prompts, null, decode or None, first-frame tokens or None)``, the Wan
    families' folders checked before the model is built (``ar_dit`` decodes with its own VAE,
    loaded after the model)."""
    from .generation_wan import wan_first_frame, wan_folders, wan_text_conditions, wan_vae_decoder

    if family.needs_vae:
        conds = [caption_conditions(config, [p], "cpu")[0] for p in prompts]
        return conds, caption_conditions(config, prompts[:1], "cpu")[1], None, None
    text_encoder, vae = wan_folders(config, text_encoder, vae)
    conds, null = wan_text_conditions(text_encoder, config, prompts, "cpu")
    first = None if image is None else wan_first_frame(vae, config, image)
    return conds, null, wan_vae_decoder(vae, config), first


def generate(
    checkpoint,
    prompt: str,
    frames: int,
    *,
    switches: Sequence[Tuple[int, str]] = (),
    image: Optional[str] = None,
    output: str = "generated",
    sink: int = 0,
    window: Optional[int] = None,
    recache: str = "block_causal",
    seed: int = 0,
    text_encoder: Optional[str] = None,
    vae: Optional[str] = None,
    log=print,
) -> dict:
    """Stream ``frames`` raw frames of ``prompt`` from the newest checkpoint under ``checkpoint``
    (``switches``: ``(raw frame, prompt)`` pairs) into ``output``.mp4 / .gif. Collective over the
    initialised process group: CP over all its ranks (Ulysses over the heads that divide, ring for
    the rest; a world of one: a single process). The Wan families read ``text_encoder`` (a local
    UMT5 / T5 folder) and ``vae`` (a local ``AutoencoderKLWan`` folder; default the checkpoint's
    ``vae.diffusers``). ``recache``: the prompt-switch KV re-cache, ``"block_causal"`` (ours)
    or ``"longlive"`` (LongLive v1.0's; docs/generation.md). Returns the paths, frames,
    per-block times and (logging rank) the generated ``tokens [1, F*h*w, C]``."""
    import torch.distributed as dist

    from megatron_video.compat import ensure_cpu_mode

    from .families import get_family

    config, folder, step = read_checkpoint_config(checkpoint)
    family = get_family(config.model.family)
    F, lat_switches = _check_request(config, family, frames, switches, image, sink, window, recache)
    prompts = [prompt] + [p for _, p in lat_switches]
    conds, null, decode, first = _conditions(config, family, prompts, image, text_encoder, vae)
    if not torch.cuda.is_available():
        ensure_cpu_mode()
    model, groups = _load_model(config, folder, step)
    if family.needs_vae:
        decode = _project_decoder(config)
    dev = next(model.parameters()).device
    conds, null = [tuple(t.to(dev) for t in c) for c in conds], tuple(t.to(dev) for t in null)
    cond, switch_conds = conds[0], [(f, c) for (f, _), c in zip(lat_switches, conds[1:])]
    nb = config.model.frames_per_block
    _, Hp, Wp = token_grid_of(config)
    C = config.vae.latent_channels * int(torch.tensor(config.model.patch_size).prod())

    def noise_block(j):
        g = sample_generator(seed, 10**9 + 1, j)
        return torch.randn(1, nb * Hp * Wp, C, generator=g).to(dev)

    writer = _VideoSink(output, config, decode, prompt, switches) if dist.get_rank() == 0 else None
    first = None if first is None else first.to(dev)
    blocks = Generator(model, config, family, groups).ar_blocks(
        cond, null, noise_block, F // nb, sink=sink, window=window, switches=switch_conds,
        first_frame=first, recache=recache,
    )  # fmt: skip
    times, t0 = [], time.time()
    with torch.no_grad():
        for j, block, _ in blocks:
            times.append(time.time() - t0)
            if writer is not None:
                writer.add(j, block)
                log(
                    f"[megatron-video] block {j + 1}/{F // nb} (latent frames {j * nb}-"
                    f"{(j + 1) * nb - 1}): {times[-1]:.2f} s"
                )
            t0 = time.time()
    result = dict(frames=frames, latent_frames=F, block_seconds=times, step=step)
    return {**result, **(writer.close() if writer is not None else {})}


def _load_model(config: Config, folder: Path, step: int):
    """The family's model with the checkpoint's weights, CP over the whole world (TP = PP = 1)."""
    import torch.distributed as dist

    from megatron_video.compat import initialize_model_parallel
    from megatron_video.parallel.topology import init_video_parallel

    from . import checkpoint as ckpt
    from .families import get_family
    from .model_factory import build_model

    world = dist.get_world_size()
    heads = config.model.num_attention_heads
    U = max(u for u in range(1, world + 1) if world % u == 0 and heads % u == 0)
    p = config.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = 1, 1
    p.context_parallel_size, p.ulysses_size, p.ring_size = world, U, world // U
    kw = dict(context_parallel_size=world)
    if 1 < U < world:
        kw["hierarchical_context_parallel_sizes"] = [U, world // U]
    initialize_model_parallel(**kw)
    groups = init_video_parallel(U, world // U, ranks_per_node=world, placement="ulysses_inner")
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(config.train.seed)
    family = get_family(config.model.family)
    tcfg = family.transformer_config(config, torch.cuda.is_available())
    model = build_model(config, tcfg)
    if torch.cuda.is_available():
        model.cuda()
    ckpt.load_model_weights(folder, model, step)
    return model.eval(), groups
