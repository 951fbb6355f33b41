"""The Hugging Face text path (data.text.HFTextEncoder) with a tiny random T5 and a WordLevel
tokenizer trained in the test (nothing downloaded): embeddings, masks, local save/load, precompute."""

import pytest
import torch

from megatron_video.data.text import HFTextEncoder

CAPTIONS = ["a small red circle bouncing left to right", "a large blue square", "a cyan diamond"]


def _tiny(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        CAPTIONS * 2, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "</s>"])
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=fast.vocab_size,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    enc = transformers.T5EncoderModel(cfg).eval()
    fast.save_pretrained(tmp_path / "t5")
    enc.save_pretrained(tmp_path / "t5", safe_serialization=True)
    return fast, enc


def test_hf_text_encoder_embeddings_and_local_load(tmp_path):
    fast, enc = _tiny(tmp_path)
    te = HFTextEncoder(fast, enc, max_len=10)
    emb, mask = te(CAPTIONS)
    assert emb.shape == (3, 10, 16) and mask.shape == (3, 10) and te.dim == 16
    assert mask.sum(1).tolist() == [8, 4, 3]  # words + nothing else (no eos added)
    assert (emb[~mask] == 0).all()
    ids = fast(CAPTIONS[1:2], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = enc(input_ids=ids).last_hidden_state[0]
    # T5 attention with padding masked equals the unpadded encoding at the real positions
    assert torch.allclose(emb[1, :4], ref, atol=1e-5)
    loaded = HFTextEncoder.from_pretrained(str(tmp_path / "t5"), max_len=10)  # local folder, no hub
    emb2, mask2 = loaded(CAPTIONS)
    assert torch.equal(mask2, mask) and torch.allclose(emb2, emb, atol=1e-6)
    with pytest.raises(ValueError, match=r"max_len \(0\) must be a positive integer"):
        HFTextEncoder(fast, enc, max_len=0)
    with pytest.raises(ValueError, match="captions must be a sequence of strings"):
        te("one string")


def test_precompute_stores_text_embeddings(tmp_path):
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos
    from megatron_video.data.shards import ShardReader
    from megatron_video.models.vae import CausalVideoVAE
    from megatron_video.training.config import load_config
    from megatron_video.training.precompute import precompute_latents

    fast, enc = _tiny(tmp_path)
    write_procedural_videos(tmp_path / "src", 2, num_frames=29, height=32, width=32)
    prepare_dataset(tmp_path / "src", tmp_path / "ds")
    torch.save(
        {
            "state_dict": CausalVideoVAE(3, 4, 8).state_dict(),
            "latent_scale": 1.0,
            "key": {"latent_channels": 4, "base_channels": 8},
        },
        tmp_path / "vae.pt",
    )
    cfg = load_config(
        None,
        [
            f"data.path={tmp_path / 'ds'}",
            f"vae.weights={tmp_path / 'vae.pt'}",
            "vae.base_channels=8",
            "vae.latent_channels=4",
        ],
    )
    te = HFTextEncoder(fast, enc, max_len=12)
    precompute_latents(cfg, tmp_path / "lat", sp_size=2, text_encoder=te)
    for s in ShardReader(str(tmp_path / "lat")):
        emb, mask = te([s["caption"]])
        assert torch.equal(s["text_mask"], mask[0]) and torch.allclose(s["text_emb"], emb[0])


def test_text_embedder_projects_precomputed_embeddings():
    from megatron_video.models.embedders import TextEmbedder

    te = TextEmbedder(10, 8, 5, seed=3, input_dim=6)
    emb = torch.randn(2, 5, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out, m = te(emb, mask, drop=torch.tensor([False, True]))
    ref = (emb[0] @ te.proj.weight.T + te.proj.bias) * mask[0, :, None]
    assert torch.allclose(out[0], ref, atol=1e-6) and torch.equal(m[0], mask[0])
    assert (
        torch.equal(out[1], te.captions.null(1)[0][0]) and m[1].all()
    )  # CFG drop: the null caption
    with pytest.raises(ValueError, match=r"caption embeddings \(2, 5, 7\).*input_dim=6"):
        te(torch.randn(2, 5, 7), mask)
    ids_out, _ = te(torch.zeros(2, 5, dtype=torch.long), mask)  # ids still work
    assert ids_out.shape == (2, 5, 8)


def _train_on_text_embeddings(tmp, lat):
    import warnings

    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = tiny_config(
        "ar_dit", tmp, context_parallel_size=2, ulysses_size=2, ring_size=1, ranks_per_node=2
    )
    cfg.data.source, cfg.data.shards, cfg.data.text_embed_dim = "shards", lat, 16
    cfg.output, cfg.train.steps = f"{tmp}/run_text", 4
    t = Trainer(cfg, progress=False)
    try:
        w0 = t.model.text_embedder.proj.weight.detach().clone()
        mb = next(t.batches.held_out().step_batches(0))
        losses = [t.train_step(s)["loss"] for s in range(4)]
        moved = not torch.equal(w0, t.model.text_embedder.proj.weight.detach())
        return dict(
            losses=losses, moved=moved, ids=(tuple(mb.caption_ids.shape), mb.caption_ids.dtype)
        )
    finally:
        t.close()


def test_training_conditions_on_precomputed_text_embeddings(pool4, tmp_path):
    """precompute --text-encoder -> latent shards with caption embeddings -> the DiT trains on them
    (DP2 x CP2), its projection learns."""
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos
    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.precompute import precompute_latents

    fast, enc = _tiny(tmp_path)
    write_procedural_videos(tmp_path / "src", 4, num_frames=13, height=16, width=16)
    prepare_dataset(tmp_path / "src", tmp_path / "ds")
    cfg = tiny_config("ar_dit", str(tmp_path))
    cfg.data.path = str(tmp_path / "ds")
    precompute_latents(
        cfg, tmp_path / "lat", sp_size=2, text_encoder=HFTextEncoder(fast, enc, max_len=16)
    )
    out = pool4.run(_train_on_text_embeddings, str(tmp_path), str(tmp_path / "lat"))
    for r in out:
        assert r["ids"] == ((1, 16, 16), torch.float32)
        assert r["moved"]
        assert all(x is None or torch.isfinite(torch.tensor(x)) for x in r["losses"])
