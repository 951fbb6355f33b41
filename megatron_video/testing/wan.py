"""Tiny Wan pieces for tests (nothing downloaded): a random diffusers ``WanTransformer3DModel``
and a complete tiny ``WanPipeline`` (WordLevel tokenizer trained here, UMT5 encoder,
``AutoencoderKLWan``, flow-matching Euler scheduler)."""

from __future__ import annotations

import torch

__all__ = ["tiny_wan_transformer", "tiny_wan_pipeline", "TINY_WAN"]

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


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"])
    tok.train_from_iterator([" ".join(WORDS)], trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def tiny_wan_pipeline(transformer=None):
    """``WanPipeline`` with tiny random parts: VAE 2x spatial / 2x temporal, 4 latent channels,
    UMT5 of width ``TINY_WAN['text_dim']``; ``transformer`` defaults to ``tiny_wan_transformer()``."""
    import transformers
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    tokenizer = _tokenizer()
    torch.manual_seed(0)
    text_encoder = transformers.UMT5EncoderModel(
        transformers.UMT5Config(
            vocab_size=tokenizer.vocab_size,
            d_model=TINY_WAN["text_dim"],
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).eval()
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
