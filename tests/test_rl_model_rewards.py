"""A model reward from a local folder (``rl.model_rewards.CLIPVideoTextReward``): a tiny random
CLIP (model, tokenizer, image processor) saved to ``tmp_path``, nothing downloaded. The score of
each video equals the mean over its frames of ``CLIPModel.forward``'s image-text logit divided by
its logit scale (the cosine similarity); it resolves as
``rl.reward`` from a user's module and passes the reward checks; a bad folder or missing videos
is a ``ValueError``."""

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

CAPTION = "a small red circle bouncing left to right"


def _bytes_to_unicode():
    """GPT-2's byte -> printable character map (CLIP's byte-level BPE alphabet)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in bs]
    return [chr(b) for b in bs] + [chr(256 + i) for i in range(len(extra))]


def _save_tiny_clip(folder):
    """A random CLIP (1 layer each side, width 32, 16x16 images in 8x8 patches) and a processor
    whose tokenizer has one token per byte (no merges)."""
    import transformers

    chars = list(_bytes_to_unicode())
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars])}
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tok = transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    size = dict(shortest_edge=16)
    images = transformers.CLIPImageProcessor(size=size, crop_size=dict(height=16, width=16))
    transformers.CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(folder)
    torch.manual_seed(0)
    layer = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2)
    cfg = transformers.CLIPConfig(
        text_config=dict(
            layer,
            vocab_size=len(vocab),
            max_position_embeddings=64,
            bos_token_id=len(vocab) - 2,
            eos_token_id=len(vocab) - 1,
            pad_token_id=len(vocab) - 1,
        ),
        vision_config=dict(layer, image_size=16, patch_size=8),
        projection_dim=16,
    )
    transformers.CLIPModel(cfg).save_pretrained(folder)


def _videos():
    g = torch.Generator().manual_seed(1)
    return torch.rand(3, 3, 4, 24, 20, generator=g, dtype=torch.float64) * 2 - 1


def _oracle(folder, videos, caption):
    """``[G, T]``: each frame's ``CLIPModel(...).logits_per_image / logit_scale.exp()``."""
    import transformers

    model = transformers.CLIPModel.from_pretrained(folder).eval()
    proc = transformers.CLIPProcessor.from_pretrained(folder)
    G, _, T = videos.shape[:3]
    frames = [((videos[g, :, t].float() + 1) / 2).permute(1, 2, 0).numpy()
              for g in range(G) for t in range(T)]  # fmt: skip
    x = proc(text=[caption], images=frames, return_tensors="pt", do_rescale=False)
    with torch.no_grad():
        out = model(**x)
        return (out.logits_per_image[:, 0] / model.logit_scale.exp()).double().view(G, T)


def test_clip_reward_equals_the_models_own_similarity(tmp_path, monkeypatch):
    from megatron_video.rl import rewards
    from megatron_video.rl.model_rewards import CLIPVideoTextReward

    folder = tmp_path / "clip"
    _save_tiny_clip(folder)
    videos = _videos()
    sims = _oracle(folder, videos, CAPTION)
    want = sims.mean(dim=1)
    (tmp_path / "my_rewards.py").write_text(
        "from megatron_video.rl.model_rewards import CLIPVideoTextReward\n"
        f"clip = CLIPVideoTextReward({str(folder)!r})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    got = rewards.score("my_rewards:clip", 3, None, caption=CAPTION, videos=videos, position=0)
    assert got.dtype == torch.float64 and got.shape == (3,)
    assert (got - want).abs().max() < 1e-5, (got, want)  # float32 model, two code paths
    assert float(want.std()) > 1e-4, want  # the videos score differently
    two = CLIPVideoTextReward(str(folder), frames=2)(None, CAPTION, videos=videos)
    assert (two - sims[:, [0, 3]].mean(dim=1)).abs().max() < 1e-5
    with pytest.raises(ValueError, match=r"rl.reward function my_rewards:clip raised ValueError"):
        rewards.score("my_rewards:clip", 3, None, caption=CAPTION)  # no decoded videos
    sys.modules.pop("my_rewards", None)


def test_clip_reward_bad_arguments(tmp_path):
    from megatron_video.rl.model_rewards import CLIPVideoTextReward

    with pytest.raises(ValueError, match=r"folder .* must be a local folder"):
        CLIPVideoTextReward(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"frames \(0\) must be None \(all\) or a positive int"):
        CLIPVideoTextReward(str(tmp_path), frames=0)
