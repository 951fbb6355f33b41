"""The trainer's config wired to ``megatron_video.generation``: ``train.sample`` (``training_sample``,
the held-out captions generated and decoded) and ``megatron-video generate`` (``generate``: a
checkpoint of the trainer, its ``video_config.json`` fixing the model, streamed block by block
into an mp4 and a GIF). The sampling itself (``generation.generator.Generator``), the video files
and the option checks (``generation.video_out``) and the Wan folders (``generation.wan_io``) live
in ``generation/``; here: config -> ``SampleSpec``, checkpoint -> model, noise seeds. Design:
docs/generation.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

from megatron_video.generation import video_out
from megatron_video.generation.generator import Generator, SampleSpec, caption_conditions

from .batches.fixed import sample_generator
from .config import Config, config_from_dict, config_to_dict, latent_shape, token_grid_of
from .ti2v import i2v_probability_of

__all__ = [
    "CONFIG_FILE",
    "config_file",
    "sample_spec",
    "trainer_generator",
    "sample_tokens",
    "training_sample",
    "read_checkpoint_config",
    "generate",
]

CONFIG_FILE = "video_config.json"  # the whole config, in every checkpoint of the trainer


def config_file(config: Config) -> dict:
    """``{CONFIG_FILE: json}``: what a checkpoint carries so ``generate`` can rebuild the model."""
    return {CONFIG_FILE: json.dumps(config_to_dict(config))}


def sample_spec(config: Config, family) -> SampleSpec:
    """The ``SampleSpec`` of a config's trained sample and its family (``model.family``)."""
    d = config.diffusion
    return SampleSpec(
        token_grid=token_grid_of(config),
        patch_size=tuple(config.model.patch_size),
        latent_channels=config.vae.latent_channels,
        latent_frames=latent_shape(config)[0],
        frames_per_block=config.model.frames_per_block,
        autoregressive=bool(family.autoregressive),
        objective=d.objective,
        guidance_scale=d.guidance_scale,
        sample_steps=d.sample_steps,
        flow_shift=d.flow_shift,
        sigma_data=d.sigma_data,
        sampler=d.sampler,
    )


def trainer_generator(trainer) -> Generator:
    """The ``Generator`` of a ``Trainer``'s model, groups and sample layout."""
    return Generator(
        model=trainer.ddp,
        spec=sample_spec(trainer.config, trainer.family),
        groups=trainer.groups,
        geometry=trainer.geometry,
        token_ids=trainer.batches.token_ids,
        progress=trainer.progress,
        placed=trainer.batches.placed(1) if hasattr(trainer.batches, "placed") else None,
    )


def _sample_noise(spec: SampleSpec, seed: int, num_samples: int) -> torch.Tensor:
    """``[b, N, C]`` noise of ``train.sample``: sample ``i``'s from ``sample_generator(seed,
    10**9, i)``."""
    T, Hp, Wp = spec.token_grid
    shape = (T * Hp * Wp, spec.channels)
    gens = [sample_generator(seed, 10**9, i) for i in range(num_samples)]
    return torch.stack([torch.randn(*shape, generator=g) for g in gens])


def _trainer_tokens(trainer, cond, null, num_samples: int) -> torch.Tensor:
    """The trainer's model, in eval mode, sampled from ``train.sample``'s noise (collective)."""
    gen = trainer_generator(trainer)
    noise = _sample_noise(gen.spec, trainer.config.train.seed, num_samples)
    trainer.ddp.eval()
    try:
        return gen.sample_tokens(cond, null, noise)
    finally:
        trainer.ddp.train()


def sample_tokens(trainer, num_samples: int) -> torch.Tensor:
    """The full clean tokens ``[b, N, C]`` of ``train.sample``'s held-out captions (collective)."""
    c = trainer.config
    items = _held_out(c, num_samples)
    captions = [it["caption"] for it in items]
    cond, null = caption_conditions(c.data.caption_len, captions, trainer.device)
    return _trainer_tokens(trainer, cond, null, num_samples)


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
    from megatron_video.generation.wan_io import wan_vae_decoder
    from megatron_video.models.embedders import unpatchify

    c = trainer.config
    mb = next(iter(trainer.batches.held_out().step_batches(0)))
    text = (mb.caption_ids * mb.caption_mask.to(mb.caption_ids.dtype)[..., None])[:num_samples]
    text = text.to(trainer.device)
    full = _trainer_tokens(trainer, (text,), (torch.zeros_like(text),), text.shape[0])
    if not trainer.is_logger:
        return None
    g = trainer.geometry
    latents = unpatchify(
        full.cpu(), tuple(c.model.patch_size), (g.frames, g.height, g.width), c.vae.latent_channels
    )
    out = {"latents": latents, "frames": int(latents.shape[2])}
    if c.vae.diffusers:
        out["video"] = wan_vae_decoder(c.vae.diffusers, c.vae.latent_channels)(latents).float()
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


def _check_request(
    config: Config, family, frames: int, switches, image, sink=0, window=None, recache=None
) -> Tuple[int, list]:
    """``(latent frames, (latent frame, prompt) switches)`` of a ``generate`` request, checked
    against the checkpoint's config before anything is loaded (ValueError naming the option)."""
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
    F = video_out.raw_frames_to_latent(frames, nb)
    video_out.check_window(nb, sink, window)
    return F, video_out.latent_switches(switches, frames, nb)


def _conditions(config: Config, family, prompts, image, text_encoder, vae):
    """``(conds of the prompts, null, decode or None, first-frame tokens or None)``, the Wan
    families' folders checked before the model is built (``ar_dit`` decodes with its own VAE,
    loaded after the model)."""
    from megatron_video.generation import wan_io

    from .precompute import wan_vae_encoder

    c, d = config, config.data
    if family.needs_vae:
        conds = [caption_conditions(d.caption_len, [p], "cpu")[0] for p in prompts]
        return conds, caption_conditions(d.caption_len, prompts[:1], "cpu")[1], None, None
    text_encoder, vae = wan_io.wan_folders(c.model.family, text_encoder, vae, c.vae.diffusers)
    conds, null = wan_io.wan_text_conditions(
        text_encoder, d.caption_len, d.text_embed_dim, prompts, "cpu"
    )
    first = None
    if image is not None:
        encode = lambda x: wan_vae_encoder(vae, c.vae.latent_channels)(x)  # noqa: E731
        first = wan_io.wan_first_frame(encode, image, d.height, d.width, c.model.patch_size)
    return conds, null, wan_io.wan_vae_decoder(vae, c.vae.latent_channels), first


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
    spec = sample_spec(config, family)
    nb, (_, Hp, Wp) = spec.frames_per_block, spec.token_grid

    def noise_block(j):
        g = sample_generator(seed, 10**9 + 1, j)
        return torch.randn(1, nb * Hp * Wp, spec.channels, generator=g).to(dev)

    writer = None
    if dist.get_rank() == 0:
        writer = video_out.VideoSink(output, spec, decode, prompt, switches)
    first = None if first is None else first.to(dev)
    blocks = Generator(model, spec, groups).ar_blocks(
        cond, null, noise_block, F // nb, sink=sink, window=window, switches=switch_conds,
        first_frame=first, recache=recache,
    )  # fmt: skip
    times = video_out.stream_video(blocks, F // nb, nb, writer, log)
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
