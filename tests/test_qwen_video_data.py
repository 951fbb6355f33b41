"""Qwen2.5-VL video QA from megatron-energon (data.qwen_video_qa) against transformers' processor
conventions: smart_resize, fps sampling -> temporal grid, pixel rows (transformers' PIL image
processor frame by frame as the oracle), chat-template tokens; each CP rank decodes only the frames
of its temporal patches."""

import math

import pytest
import torch

from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos
from megatron_video.data.qwen_video_qa import (
    QwenVideoQA,
    VideoProcessing,
    plan_video,
    sample_frame_indices,
    smart_resize,
)
from megatron_video.testing.qwen_processor import image_processor, tiny_tokenizer

T, H, W, FPS = 37, 40, 56, 10  # 37 frames at 10 fps, sampled at 4 fps: 14 frames, 7 patches


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_energon")
    paths = write_procedural_videos(root / "src", 1, num_frames=T, height=H, width=W, fps=FPS)
    prepare_dataset(root / "src", root / "ds")
    tok = tiny_tokenizer(
        [p.with_suffix(".txt").read_text() for p in paths] + ["Describe this video."]
    )
    return root, tok


def _full_frames(path):
    import av

    with av.open(str(path)) as c:
        return torch.stack(
            [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in c.decode(video=0)]
        )


def _oracle_rows(frames, idx, nums):
    """transformers' image processor on each sampled frame; temporal slot k of a video patch is
    slot k of frame 2u + k's (the image processor repeats a frame over the temporal slots)."""
    out = image_processor(**nums)(images=[frames[i].numpy() for i in idx], return_tensors="pt")
    P, tp = nums["patch"], nums["temporal"]
    rows = out["pixel_values"].reshape(len(idx), -1, 3, tp, P * P)
    ref = torch.stack([rows[k::tp, :, :, k] for k in range(tp)], 3)
    return ref.reshape(len(idx) // tp * rows.shape[1], -1), out["image_grid_thw"][0]


def test_smart_resize_and_fps_sampling_match_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref

    for h, w in ((40, 56), (480, 854), (1080, 1920), (17, 300), (7, 9)):
        for lo, hi in ((16 * 16, 32 * 32), (128 * 28 * 28, 768 * 28 * 28)):
            f = 8 if hi < 2000 else 28
            assert smart_resize(h, w, f, lo, hi) == ref(h, w, f, lo, hi)
    # Qwen2VLVideoProcessor.sample_frames: n = floor(clamp(total / fps * 2, 4, 768, total) / 2) * 2
    proc = VideoProcessing()
    for total, fps in ((37, 10.0), (600, 30.0), (30000, 25.0), (5, 30.0)):
        n = min(max(total / fps * 2, 4), math.floor(min(768, total) / 2) * 2, total)
        n = math.floor(n / 2) * 2
        want = torch.arange(0, total, total / n).int().tolist()
        assert sample_frame_indices(total, fps, proc) == want
    plan = plan_video(dict(num_frames=600, fps=30.0, height=360, width=640), proc)  # long video
    assert len(plan.indices) == 40 and plan.grid == (20, 26, 46)  # 360x640 -> 364x644
    assert plan.second_per_grid_t == pytest.approx(1.0)


@pytest.mark.parametrize("max_pixels", [64 * 64, 32 * 32])  # no resize (exact), bicubic resize
def test_pixels_grid_tokens_match_processor(data, max_pixels):
    from transformers.video_utils import VideoMetadata

    root, tok = data
    nums = dict(patch=4, temporal=2, merge=2, min_pixels=16 * 16, max_pixels=max_pixels)
    qa = QwenVideoQA(root / "ds", tok, VideoProcessing(**nums, fps=4.0))
    key = sorted(qa.records)[0]
    s = qa.sample(key)
    frames = _full_frames(root / "src" / qa.records[key]["source"])
    idx = plan_video(qa.records[key], qa.proc).indices
    assert len(idx) == 14
    ref, (_, gh, gw) = _oracle_rows(frames, idx, nums)
    assert s["video_grid_thw"].tolist() == [[7, int(gh), int(gw)]]
    # PIL's bicubic (the oracle's) and torch's / torchvision's differ by a few grey levels
    tol = 0 if max_pixels == 64 * 64 else 0.15
    assert (s["pixel_values_videos"] - ref).abs().max() <= tol
    meta = VideoMetadata(total_num_frames=T, fps=FPS, frames_indices=list(idx))
    assert s["second_per_grid_ts"].item() == pytest.approx(2 / meta.sampled_fps)
    # tokens: the chat template's text, the video pad expanded to t*h*w / merge^2 tokens
    n = 7 * int(gh) * int(gw) // 4
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": qa.question}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|video_pad|>", "<|video_pad|>" * n)
    answer = qa.records[key]["caption"] + "<|im_end|>"
    want = tok(text + answer, add_special_tokens=False)["input_ids"]
    assert s["input_ids"].tolist() == want
    assert (s["input_ids"] == tok.convert_tokens_to_ids("<|video_pad|>")).sum() == n
    k = len(tok(answer, add_special_tokens=False)["input_ids"])
    assert s["labels"][-k:].tolist() == want[-k:] and (s["labels"][:-k] == -100).all()


def test_each_cp_rank_decodes_only_its_frames(data):
    """CP 4 over 7 temporal patches: each rank's rows are the full sample's rows of its units, it
    decodes at most its units' span of source frames, and the ranks' decodes do not overlap."""
    root, tok = data
    proc = VideoProcessing(patch=4, temporal=2, merge=2, min_pixels=256, max_pixels=4096, fps=4.0)
    qa = QwenVideoQA(root / "ds", tok, proc)
    key = sorted(qa.records)[0]
    full = qa.sample(key)
    assert qa.decoded_frames == 35  # frames 0..34 (the sampled 14 span them)
    rows = full["pixel_values_videos"].reshape(7, -1, full["pixel_values_videos"].shape[-1])
    stride = math.ceil(T / 14)
    total = 0
    for r in range(4):
        qa.decoded_frames = 0
        s = qa.sample(key, cp_rank=r, cp_size=4)
        u = s["local_units"]
        assert torch.equal(s["pixel_values_videos"], rows[u].reshape(-1, rows.shape[-1]))
        assert torch.equal(s["input_ids"], full["input_ids"])
        assert 0 < qa.decoded_frames <= len(u) * proc.temporal * stride
        total += qa.decoded_frames
    assert total <= 35


def test_bad_inputs_named(data, tmp_path):
    root, tok = data
    qa = QwenVideoQA(root / "ds", tok, VideoProcessing(patch=4, min_pixels=256, max_pixels=4096))
    key = sorted(qa.records)[0]
    with pytest.raises(ValueError, match=r"cp_size \(8\) must be <= clip .* temporal patches \(3 "):
        qa.sample(key, cp_rank=0, cp_size=8)  # fps 2: 7 sampled frames -> 6 -> 3 patches
    with pytest.raises(ValueError, match="cp_rank"):
        qa.sample(key, cp_rank=4, cp_size=4)
    with pytest.raises(ValueError, match=r"units \(\[3\]\) must be clip .*'s temporal patches"):
        qa.sample(key, cp_rank=0, cp_size=2, units=[3])  # 3 patches: 0..2
    with pytest.raises(ValueError, match="fps"):
        VideoProcessing(fps=0.0)
    with pytest.raises(ValueError, match=r"fps \(0.0\) must be > 0"):
        plan_video(dict(num_frames=10, fps=0.0, height=32, width=32), VideoProcessing())
    bare = tiny_tokenizer(["a b"])
    bare.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="chat_template must render one"):
        QwenVideoQA(root / "ds", bare).prompt()


def test_processing_from_folder_and_model_mismatch_named(data, tmp_path):
    import json

    from megatron_video.data.qwen_video_qa import check_matches_model, processing_from_folder
    from megatron_video.models.qwen_vl.config import tiny_hf_config

    _, tok = data
    # the published Qwen2.5-VL-7B-Instruct preprocessor_config.json's fields
    cfg = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
               merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
               image_std=[0.26862954, 0.26130258, 0.27577711])  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    p = processing_from_folder(tmp_path)
    assert (p.patch, p.temporal, p.merge, p.min_pixels, p.max_pixels) == (14, 2, 2, 3136, 12845056)
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps(dict(cfg, size={"shortest_edge": 4, "longest_edge": 8}, fps=1.0))
    )
    p = processing_from_folder(tmp_path)
    assert (p.min_pixels, p.max_pixels, p.fps) == (4, 8, 1.0)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(dict(image_std=[0.5] * 3)))
    with pytest.raises(ValueError, match=r"image_std \(\[0.5, 0.5, 0.5\]\) must be CLIP's"):
        processing_from_folder(tmp_path)
    with pytest.raises(ValueError, match="must hold a"):
        processing_from_folder(tmp_path / "nowhere")
    hf = tiny_hf_config()  # patch 4, temporal 2, merge 2
    names = {"video_token_id": "<|video_pad|>", "vision_start_token_id": "<|vision_start|>"}
    names["vision_end_token_id"] = "<|vision_end|>"
    ids = {n: tok.convert_tokens_to_ids(t) for n, t in names.items()}
    proc = VideoProcessing(patch=4, min_pixels=256, max_pixels=4096)
    with pytest.raises(
        ValueError, match=r"tokenizer's <\|video_pad\|> id \(6\) must equal .*video_token_id \(91\)"
    ):
        check_matches_model(proc, hf, tok)
    for k, v in ids.items():
        setattr(hf, k, v)
    check_matches_model(proc, hf, tok)
    with pytest.raises(ValueError, match=r"processor patch \(14\) must equal .* \(4\)"):
        check_matches_model(VideoProcessing(), hf, tok)
