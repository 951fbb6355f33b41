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
    tok.train_from_iterator(CAPTIONS * 2, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "</s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                eos_token="</s>")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=fast.vocab_size, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)
    enc = transformers.T5EncoderModel(cfg).eval()
    fast.save_pretrained(tmp_path / "t5")
    enc.save_pretrained(tmp_path / "t5", safe_serialization=True)
    return fast, enc


def test_hf_text_encoder_embeddings_and_local_load(tmp_path):
    fast, enc = _tiny(tmp_path)
    te = HFTextEncoder(fast, enc, max_len=10)
    emb, mask = te(CAPTIONS)
    assert emb.shape == (3, 10, 16) and mask.shape == (3, 10) and te.dim == 16
    assert mask.sum(1).tolist() == [8, 4, 3]                      # words + nothing else (no eos added)
    assert (emb[~mask] == 0).all()
    ids = fast(CAPTIONS[1:2], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = enc(input_ids=ids).last_hidden_state[0]
    # T5 attention with padding masked equals the unpadded encoding at the real positions
    assert torch.allclose(emb[1, :4], ref, atol=1e-5)
    loaded = HFTextEncoder.from_pretrained(str(tmp_path / "t5"), max_len=10)   # local folder, no hub
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
    torch.save({"state_dict": CausalVideoVAE(3, 4, 8).state_dict(), "latent_scale": 1.0,
                "key": {"latent_channels": 4, "base_channels": 8}}, tmp_path / "vae.pt")
    cfg = load_config(None, [f"data.path={tmp_path / 'ds'}", f"vae.weights={tmp_path / 'vae.pt'}",
                             "vae.base_channels=8", "vae.latent_channels=4"])
    te = HFTextEncoder(fast, enc, max_len=12)
    precompute_latents(cfg, tmp_path / "lat", sp_size=2, text_encoder=te)
    for s in ShardReader(str(tmp_path / "lat")):
        emb, mask = te([s["caption"]])
        assert torch.equal(s["text_mask"], mask[0]) and torch.allclose(s["text_emb"], emb[0])
