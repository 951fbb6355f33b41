"""Tiny random Wan pieces for tests (nothing downloaded): a diffusers ``WanTransformer3DModel``,
a complete tiny ``WanPipeline`` (WordLevel tokenizer trained here, UMT5 encoder,
``AutoencoderKLWan``, flow-matching Euler scheduler), the training config, latent shards, and the
transformer / VAE / UMT5 encoder saved locally."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

__all__ = [
    "TINY_WAN",
    "TEXT_DIM",
    "TEXT_LEN",
    "tiny_wan_transformer",
    "tiny_wan_pipeline",
    "tiny_wan_config",
    "write_random_latent_shards",
    "save_tiny_wan_transformer",
    "save_tiny_wan_vae",
    "tiny_wan_vae",
    "WAN22_VAE_KEYS",
    "save_tiny_umt5",
]

TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=96,
    num_layers=2,
    rope_max_seq_len=64,
)
WORDS = "a red cat on the moon blue small large dog runs".split()


def tiny_wan_transformer(seed: int = 0, **extra):
    """Random ``WanTransformer3DModel`` of ``TINY_WAN`` (+ ``extra``), biases perturbed so none
    is zero; the same on every process (seeded)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**TINY_WAN, **extra})
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def _tokenizer(texts: Sequence[str]):
    """A WordLevel tokenizer trained on ``texts`` (ids: ``<pad>`` 0, ``<unk>`` 1, ``</s>`` 2)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        list(texts) * 2, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "</s>"])
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def _umt5(vocab_size: int, d_model: int, num_layers: int):
    """A random tiny ``UMT5EncoderModel`` (seeded)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.UMT5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=8,
        d_ff=64,
        num_layers=num_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    return transformers.UMT5EncoderModel(cfg).eval()


def tiny_wan_pipeline(transformer=None):
    """``WanPipeline`` with tiny random parts: VAE 2x spatial / 2x temporal, 4 latent channels,
    UMT5 of width ``TINY_WAN['text_dim']``; ``transformer`` defaults to ``tiny_wan_transformer()``."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    tokenizer = _tokenizer(WORDS)
    text_encoder = _umt5(tokenizer.vocab_size, TINY_WAN["text_dim"], num_layers=1)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=TINY_WAN["in_channels"],
        dim_mult=[1, 1],
        num_res_blocks=1,
        temperal_downsample=[True],
        latents_mean=[0.0] * TINY_WAN["in_channels"],
        latents_std=[1.0] * TINY_WAN["in_channels"],
        scale_factor_temporal=2,
        scale_factor_spatial=2,
    ).eval()
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=(transformer if transformer is not None else tiny_wan_transformer()).eval(),
    )


TEXT_DIM, TEXT_LEN = 32, 7


def tiny_wan_config(family: str, tmp, shards, **parallel):
    """2 layers, 4 heads x 16, FFN 96, text_dim 32; 13 raw frames of 32 x 48 (latent 4 x 4 x 6,
    tokens 4 x 2 x 3 under patch (1, 2, 2)), 4 latent channels, uniform timesteps shifted by 3."""
    from megatron_video.training.config import config_from_dict
    from megatron_video.training.families import get_family

    from .configs import TINY_TRAIN

    model = dict(
        family=family,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        patch_size=[1, 2, 2],
    )
    if get_family(family).autoregressive:
        model["frames_per_block"] = 1
    return config_from_dict(
        dict(
            model=model,
            parallel=dict(parallel),
            data=dict(
                source="shards",
                shards=str(shards),
                text_embed_dim=TEXT_DIM,
                caption_len=TEXT_LEN,
                num_frames=13,
                height=32,
                width=48,
            ),
            vae=dict(latent_channels=4, cache_dir=f"{tmp}/cache"),
            diffusion=dict(
                objective="flow", flow_shift=3.0, flow_distribution="uniform", cfg_dropout=0.5
            ),
            # seed 4: step 0 CFG-drops one of its two samples (wan and wan_ar alike)
            train=dict(TINY_TRAIN, seed=4, micro_batch_size=2),
            output=f"{tmp}/run",
        )
    )


def write_random_latent_shards(config, out_dir, num_samples: int = 4, seed: int = 0) -> str:
    """Shards in ``precompute``'s format with random latents and caption embeddings (varying
    lengths, padded positions zero) of ``config``'s sizes; returns ``out_dir``."""
    from megatron_video.training.config import latent_shape
    from megatron_video.training.precompute import LatentShardWriter

    d = config.data
    shape = (config.vae.latent_channels, *latent_shape(config))
    g = torch.Generator().manual_seed(seed)
    with LatentShardWriter(out_dir, samples_per_shard=max(1, num_samples // 2)) as w:
        for i in range(num_samples):
            n = 1 + i % d.caption_len
            mask = torch.arange(d.caption_len) < n
            emb = torch.randn(d.caption_len, d.text_embed_dim, generator=g) * mask[:, None]
            lat = torch.randn(*shape, generator=g)
            w.write(f"s{i:04d}", dict(latent=lat, text_emb=emb, text_mask=mask), f"clip {i}", {})
    return str(out_dir)


def save_tiny_wan_transformer(folder, config, seed: int = 0) -> Path:
    """A random ``WanTransformer3DModel`` of ``config``'s sizes (norms and biases perturbed so no
    weight is trivial) saved as safetensors under ``folder``."""
    from diffusers import WanTransformer3DModel

    from megatron_video.training.families.wan import WAN_FIXED

    m = config.model
    fixed = {k: v for k, v in WAN_FIXED.items() if k not in ("image_dim", "added_kv_proj_dim")}
    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=tuple(m.patch_size),
        num_attention_heads=m.num_attention_heads,
        attention_head_dim=m.hidden_size // m.num_attention_heads,
        in_channels=config.vae.latent_channels,
        out_channels=config.vae.latent_channels,
        text_dim=config.data.text_embed_dim,
        ffn_dim=m.ffn_hidden_size,
        num_layers=m.num_layers,
        **fixed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias") or "scale_shift_table" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(folder), safe_serialization=True)
    return Path(folder)


# Wan 2.2's VAE keys (TI2V-5B): residual blocks, a 2x2 pixel patchify inside the VAE (12 input
# channels = 3 RGB x 2 x 2), 16x spatial, 48 latent channels
WAN22_VAE_KEYS = dict(
    is_residual=True,
    patch_size=2,
    in_channels=12,
    out_channels=12,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
)


def tiny_wan_vae(z_dim: int = 4, seed: int = 0, wan22: bool = False):
    """A random tiny ``AutoencoderKLWan``: temporal stride 4, spatial 8 (Wan 2.1's structure) or,
    with ``wan22``, Wan 2.2's keys (``WAN22_VAE_KEYS``: 16x spatial; use ``z_dim`` 48)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.1 * (i % 8) for i in range(z_dim)],
        latents_std=[1.0 + 0.5 * (i % 8) for i in range(z_dim)],
        **(WAN22_VAE_KEYS if wan22 else {}),
    ).eval()


def save_tiny_wan_vae(folder, z_dim: int = 4, seed: int = 0, wan22: bool = False) -> Path:
    """``tiny_wan_vae(z_dim, seed, wan22)`` saved under ``folder``."""
    tiny_wan_vae(z_dim, seed, wan22).save_pretrained(str(folder), safe_serialization=True)
    return Path(folder)


def save_tiny_umt5(folder, captions: Sequence[str], d_model: int = TEXT_DIM) -> Path:
    """A random tiny UMT5 encoder and a WordLevel tokenizer trained on ``captions``."""
    fast = _tokenizer(captions)
    enc = _umt5(fast.vocab_size, d_model, num_layers=2)
    fast.save_pretrained(str(folder))
    enc.save_pretrained(str(folder), safe_serialization=True)
    return Path(folder)
