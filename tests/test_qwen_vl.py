"""Qwen2.5-VL on Megatron-Core (``models.qwen_vl``) against transformers' own model as the oracle.

float64, a tiny random config (``tiny_hf_config``: text 2 layers x 64, vision depth 2 with one
windowed and one full-attention block). The only change to the oracle: transformers' RMSNorm
computes in float32 even for float64 input, which caps agreement at ~1e-7; it is patched to compute
in the input dtype (``_float64_rmsnorm``). The M-RoPE frequencies are float32 in both models.
"""

import json
import zlib
from pathlib import Path

import pytest
import torch

from megatron_video.models.qwen_vl import config as qcfg
from megatron_video.models.qwen_vl import weights as W
from megatron_video.testing.qwen_vl_case import VID, _rmsnorm_in_input_dtype, token_type_ids


@pytest.fixture
def float64_rmsnorm(monkeypatch):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    monkeypatch.setattr(m.Qwen2_5_VLRMSNorm, "forward", _rmsnorm_in_input_dtype)


def hf_model(cfg, seed=0):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).double().eval()
    with torch.no_grad():  # away from the init (norms at 1, small weights): every tensor matters
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def sample(kind: str, cfg):
    """(input_ids, pixel_values_videos, video_grid_thw, labels): the processor's layout (placeholders
    expanded, ``<vision_start> video <vision_end>``). ``one``: one video of 3 temporal patches (odd)
    on a 6 x 4 patch grid; ``two``: two rows, videos of 3 (6 x 4) and 2 (4 x 4) temporal patches;
    ``cp``: two rows, videos of 5 and 4 temporal patches on one 6 x 4 grid (>= CP = 4);
    ``text``: no video."""
    g = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    if kind == "text":  # ``text``: two rows of text only (no video in the batch)
        ids = torch.randint(3, 90, (2, 13), generator=g)
        return ids, None, None, torch.randint(3, 90, ids.shape, generator=g)
    grids = {"one": [[3, 6, 4]], "two": [[3, 6, 4], [2, 4, 4]], "cp": [[5, 6, 4], [4, 6, 4]]}[kind]
    rows, lens = [], []
    for t, h, w in grids:
        n = t * h * w // 4
        pre = torch.randint(3, 90, (3,), generator=g).tolist()
        rows.append(pre + [92] + [VID] * n + [93])
        lens.append(len(rows[-1]))
    T = max(lens) + 6
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        ids[b, len(r) :] = torch.randint(3, 90, (T - len(r),), generator=g)
    grid = torch.tensor(grids)
    pv = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g, dtype=torch.float64)
    labels = torch.randint(3, 90, ids.shape, generator=g)
    labels[ids == VID] = -100
    labels[:, :2] = -100
    return ids, pv, grid, labels


def ce(logits, shifted_labels):
    """Mean float64 cross-entropy over targets != -100 (Megatron's shifted convention)."""
    lab = shifted_labels.flatten()
    return torch.nn.functional.cross_entropy(
        logits.double().flatten(0, 1), lab, ignore_index=-100, reduction="sum"
    ) / (lab != -100).sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------
# pure: the mapping table, the M-RoPE ids, bad input
# ---------------------------------------------------------------------------------------------
def test_weights_round_trip_and_strict_load():
    from transformers import Qwen2_5_VLForConditionalGeneration

    for tie in (False, True):
        cfg = qcfg.tiny_hf_config(tie_word_embeddings=tie)
        hf = hf_model(cfg)
        sd = hf.state_dict()
        ours = W.to_megatron(sd, cfg)
        assert ("language_model.output_layer.weight" in ours) is not tie
        back = W.to_hf(ours, cfg)
        assert set(back) == set(sd)
        assert all(torch.equal(back[k], sd[k]) for k in sd)  # bit-identical
        fresh = Qwen2_5_VLForConditionalGeneration(cfg).double()
        fresh.load_state_dict(back, strict=True)
        # QKV fused per query group: group 1's rows start with its first q head
        t = cfg.text_config
        d = t.hidden_size // t.num_attention_heads
        hpg = t.num_attention_heads // t.num_key_value_heads
        qkv = ours["language_model.decoder.layers.0.self_attention.linear_qkv.weight"]
        q = sd["model.language_model.layers.0.self_attn.q_proj.weight"]
        k = sd["model.language_model.layers.0.self_attn.k_proj.weight"]
        assert torch.equal(qkv[(hpg + 2) * d : (hpg + 2) * d + d], q[hpg * d : hpg * d + d])
        assert torch.equal(qkv[hpg * d : hpg * d + d], k[:d])
    legacy = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
        for k, v in sd.items()
    }
    assert W.to_megatron(legacy, cfg).keys() == ours.keys()


def test_mrope_ids_equal_transformers_get_rope_index():
    from megatron_video.models.qwen_vl import mrope_position_ids

    cfg = qcfg.tiny_hf_config()
    hf = hf_model(cfg)
    for kind in ("one", "two", "cp"):
        ids, _, grid, _ = sample(kind, cfg)
        want, _ = hf.model.get_rope_index(ids, token_type_ids(ids), video_grid_thw=grid)
        assert torch.equal(mrope_position_ids(ids, cfg, grid), want), kind
        secs = [0.5 * (j + 1) for j in range(len(grid))]
        want, _ = hf.model.get_rope_index(
            ids, token_type_ids(ids), video_grid_thw=grid, second_per_grid_ts=torch.tensor(secs)
        )
        assert torch.equal(mrope_position_ids(ids, cfg, grid, second_per_grid_ts=secs), want)


def test_bad_hf_config_and_grid():
    from transformers import Qwen2Config

    from megatron_video.models.qwen_vl import mrope_position_ids

    with pytest.raises(ValueError, match="model_type"):
        qcfg.check_hf_config(Qwen2Config())
    cfg = qcfg.tiny_hf_config()
    ids, _, grid, _ = sample("one", cfg)
    with pytest.raises(ValueError, match=r"video_grid_thw\[0\]"):
        mrope_position_ids(ids, cfg, torch.tensor([[4, 6, 4]]))
    with pytest.raises(ValueError, match="video_grid_thw"):
        mrope_position_ids(ids, cfg, torch.cat([grid, grid]))
    from megatron_video.models.qwen_vl import QwenVLModel, language_config

    with pytest.raises(ValueError, match=r"context_parallel_size \(4\).*MMSPQwenVLModel"):
        QwenVLModel(cfg, language_config(cfg, cp=4))


# ---------------------------------------------------------------------------------------------
# CP = 1: logits, loss and every gradient equal transformers'
# ---------------------------------------------------------------------------------------------
def build(cfg, tp=1, cp=1, cp_comm_type=None):
    from megatron_video.models.qwen_vl import QwenVLModel, language_config

    lcfg = language_config(cfg, tp, cp, cp_comm_type, params_dtype=torch.float64)
    return QwenVLModel(cfg, lcfg).double()


def hf_step(hf, ids, pv, grid, labels, mrope=True):
    hf.zero_grad(set_to_none=True)
    out = hf(
        input_ids=ids,
        pixel_values_videos=pv,
        video_grid_thw=grid,
        mm_token_type_ids=token_type_ids(ids) if mrope else None,
    )
    from megatron_video.models.qwen_vl import shift_labels

    loss = ce(out.logits, shift_labels(labels))
    loss.backward()
    grads = {k: p.grad for k, p in hf.named_parameters()}
    if "lm_head.weight" not in grads:  # tied: transformers lists the shared tensor once
        grads["lm_head.weight"] = grads["model.language_model.embed_tokens.weight"]
    return out.logits.detach(), loss.detach(), grads


def test_cp1_equals_transformers(float64_rmsnorm):
    from megatron_video.models.wan.convert import _one_process

    for tie in (False, True):
        cfg = qcfg.tiny_hf_config(tie_word_embeddings=tie)
        hf = hf_model(cfg)
        with _one_process():
            ours = build(cfg)
            ours.load_state_dict(W.to_megatron(hf.state_dict(), cfg), strict=True)
            for kind in ("one", "two") if not tie else ("two",):
                ids, pv, grid, labels = sample(kind, cfg)
                want, want_loss, hf_grads = hf_step(hf, ids, pv, grid, labels)
                ours.zero_grad(set_to_none=True)
                logits = ours(ids, pv, grid)
                loss = ce(logits, ours.local_labels(labels))
                loss.backward()
                scale = float(want.abs().max())
                assert float((logits - want).abs().max()) <= 1e-8 * scale, kind
                assert float(abs(loss - want_loss)) <= 1e-8 * float(want_loss), kind
                want_g = W.to_megatron({k: g for k, g in hf_grads.items()}, cfg)
                for k, p in ours.named_parameters():
                    err = float((p.grad - want_g[k]).abs().max())
                    assert err <= 1e-8 * (float(want_g[k].abs().max()) + 1e-30), (kind, k, err)
                # Megatron's own per-token loss (fp32 cross-entropy) is the same loss
                per_token, mask = ours(ids, pv, grid, labels=labels)
                assert torch.equal(mask, (ours.local_labels(labels) != -100).double())
                mean = (per_token * mask).sum() / mask.sum()
                assert float(abs(mean - want_loss)) <= 1e-5 * float(want_loss)
    # without M-RoPE (1-D positions) the logits differ: the comparison above sees positions
    pos1d = torch.arange(ids.shape[1]).expand(3, *ids.shape)
    with _one_process():
        ours = build(cfg)
        ours.load_state_dict(W.to_megatron(hf.state_dict(), cfg), strict=True)
        flat = ours(ids, pv, grid, position_ids=pos1d).detach()
    assert float((flat - want).abs().max()) > 1e-4 * scale


# ---------------------------------------------------------------------------------------------
# MM-SP: U2xR2, U4, R4, TP2xCP2 equal CP = 1 (loss and every gradient, float64)
# ---------------------------------------------------------------------------------------------
# name -> (tp, cp, hierarchical sizes, cp_comm_type)
CASES = {
    "u2xr2": (1, 4, [2, 2], "a2a+p2p"),
    "u4": (1, 4, None, "a2a"),
    "r4": (1, 4, None, "p2p"),
    "tp2xcp2": (2, 2, None, "p2p"),
}


def _mmsp_step(model, data, cp_group):
    from megatron.core import parallel_state as ps

    from megatron_video.mmsp import global_token_loss
    from megatron_video.parallel import comm

    ids, pv, grid, labels = data
    model.zero_grad(set_to_none=True)
    logits = model(ids, pv, grid, runtime_gather_output=True)
    lab = model.local_labels(labels)
    per_token = torch.nn.functional.cross_entropy(
        logits.double().flatten(0, 1), lab.flatten().clamp(min=0), reduction="none"
    ).view_as(lab)
    loss = global_token_loss(per_token, (lab != -100).double(), cp_group)
    loss.backward()
    total = loss.detach().clone()
    if cp_group is not None:
        comm.all_reduce(total, cp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        if cp_group is not None:
            comm.all_reduce(g, cp_group)  # what DDP's dp_cp reduction sums
        grads[name] = W.tp_gather(name, g, p, ps.get_tensor_model_parallel_group())
    return float(total), grads


def _mmsp_run(case_names, with_text=False):
    from megatron.core import parallel_state as ps
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    from megatron_video.mmsp.qwen_vl import MMSPQwenVLModel
    from megatron_video.models.qwen_vl import language_config
    from megatron_video.testing.parallel import model_parallel

    saved = m.Qwen2_5_VLRMSNorm.forward
    m.Qwen2_5_VLRMSNorm.forward = _rmsnorm_in_input_dtype
    try:
        cfg = qcfg.tiny_hf_config()
        full = W.to_megatron(hf_model(cfg).state_dict(), cfg)
        data = sample("cp", cfg)
        out = {}
        for case in ["reference"] + list(case_names):
            tp, cp, hier, comm_type = CASES.get(case, (1, 1, None, None))
            with model_parallel(tp=tp, cp=cp, hierarchical_cp=hier):
                lcfg = language_config(cfg, tp, cp, comm_type, params_dtype=torch.float64)
                model = MMSPQwenVLModel(cfg, lcfg).double()
                rank = ps.get_tensor_model_parallel_rank()
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(W.tp_shard(name, full[name], p, tp, rank))
                group = ps.get_context_parallel_group() if cp > 1 else None
                if with_text:  # a batch without video through the same model first
                    out[(case, "text")] = _mmsp_step(model, sample("text", cfg), group)
                # r4: each rank given only its temporal patches' rows (a loader decoding only
                # its frames, data.qwen_video_qa); the other layouts every row
                loss, grads = _mmsp_step(
                    model, _local_rows(data, cp) if case == "r4" else data, group
                )
                units, error = 0, None
                if group is not None:
                    b = model.last_mmsp_batch
                    units = int(b.shards.local_units(b.plan.rank).numel())
                    error = _short_video_error(model, cfg, cp)
                out[case] = (loss, grads, units, error)
        return out
    finally:
        m.Qwen2_5_VLRMSNorm.forward = saved


def _local_rows(data, cp):
    """``data`` with only this CP rank's temporal patches' pixel rows."""
    from megatron.core import parallel_state as ps

    from megatron_video.layouts.mmsp import frame_shards

    ids, pv, grid, labels = data
    units = frame_shards(grid[:, 0].tolist(), cp).local_units(ps.get_context_parallel_rank())
    rows = pv.reshape(-1, int(grid[0, 1] * grid[0, 2]), pv.shape[-1])[units]
    return ids, rows.reshape(-1, pv.shape[-1]), grid, labels


def _short_video_error(model, cfg, cp):
    """The ``ValueError`` of a video with fewer temporal patches than CP ranks (raised on every
    rank before any collective: a collective would hang the pool instead)."""
    ids, pv, grid, _ = sample("one", cfg)  # 3 temporal patches
    if grid[0, 0] >= cp:
        return None
    try:
        model(ids, pv, grid)
    except ValueError as e:
        return str(e)
    return "no error"


def _check_mmsp(per_rank, cases):
    for case in cases:  # a batch without video (only where the run had one)
        for res in per_rank:
            if (case, "text") in res:
                (loss, grads), (want, want_g) = res[(case, "text")], res[("reference", "text")]
                assert abs(loss - want) <= 1e-10 * want, (case, loss, want)
                for k, g in want_g.items():
                    assert float((grads[k] - g).abs().max()) <= 1e-10 * (
                        float(g.abs().max()) + 1e-30
                    ), (case, k)
    loss_ref, grads_ref = per_rank[0]["reference"][:2]
    assert loss_ref > 0
    groups = ("visual.blocks.", "visual.merger.", "visual.patch_embed.", "language_model.")
    for prefix in groups:  # the vision tower, the merger and the LLM all get gradients
        assert any(k.startswith(prefix) and grads_ref[k].abs().max() > 0 for k in grads_ref)
    for case in cases:
        for rank, res in enumerate(per_rank):
            loss, grads, _, error = res[case]
            if CASES[case][1] == 4:
                assert "video_grid_thw[0] temporal patches (3)" in error, error
            assert abs(loss - loss_ref) <= 1e-10 * loss_ref, (case, rank, loss, loss_ref)
            assert set(grads) == set(grads_ref)
            for k, g in grads_ref.items():
                err = float((grads[k] - g).abs().max())
                assert err <= 1e-10 * (float(g.abs().max()) + 1e-30), (case, rank, k, err)
        units = [res[case][2] for res in per_rank]  # stage 1: 9 temporal patches over CP
        assert sum(units) == 9 * CASES[case][0] and max(units) - min(units) <= 1, (case, units)


def test_mmsp_equals_cp1(pool4):
    cases = ["u2xr2", "r4", "tp2xcp2"]
    _check_mmsp(pool4.run(_mmsp_run, cases), cases)


def test_mmsp_ulysses4_equals_cp1(pool4):
    per_rank = pool4.run(_mmsp_run, ["u4"], True, ranks_per_node=4)
    assert all(("u4", "text") in res for res in per_rank)
    _check_mmsp(per_rank, ["u4"])


# ---------------------------------------------------------------------------------------------
# megatron-video convert --from-hf / --to-hf
# ---------------------------------------------------------------------------------------------
def _hf_folder(path, cfg, processor=None):
    hf = hf_model(cfg).float()
    hf.save_pretrained(str(path))  # transformers writes the older on-disk names (model.layers.*)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    proc = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, **(processor or {})}
    (path / "preprocessor_config.json").write_text(json.dumps(proc))
    return hf


def test_convert_cli_round_trip(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron_video.training.cli import main

    cfg = qcfg.tiny_hf_config(tie_word_embeddings=True)
    hf = _hf_folder(tmp_path / "hf", cfg)
    assert (
        main(["convert", "--from-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "c")]) == 0
    )
    assert main(["convert", "--to-hf", str(tmp_path / "c"), "--output", str(tmp_path / "o")]) == 0
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "o")).state_dict()
    want = hf.state_dict()
    assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want)
    for name in ("tokenizer_config.json", "preprocessor_config.json", "generation_config.json"):
        assert (tmp_path / "o" / name).read_text() == (tmp_path / "hf" / name).read_text()


def test_convert_refuses_other_folders(tmp_path):
    from megatron_video.models.qwen_vl.convert import read_hf_folder

    cfg = qcfg.tiny_hf_config()
    _hf_folder(tmp_path / "bad_proc", cfg, {"patch_size": 14})
    with pytest.raises(ValueError, match=r"patch_size \(14\).*vision_config.patch_size \(4\)"):
        read_hf_folder(tmp_path / "bad_proc")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": []}))
    with pytest.raises(ValueError, match=r"model_type \('qwen2'\)"):
        read_hf_folder(other)


def _load_converted(path, full):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from transformers import Qwen2_5_VLConfig

    from megatron_video.mmsp.qwen_vl import MMSPQwenVLModel
    from megatron_video.models.qwen_vl import language_config
    from megatron_video.testing.parallel import model_parallel

    meta = json.loads((Path(path) / "iter_0000000" / "qwen_vl_config.json").read_text())
    cfg = Qwen2_5_VLConfig.from_dict(meta["hf_config"])
    with model_parallel(tp=2, cp=2):
        model = MMSPQwenVLModel(cfg, language_config(cfg, 2, 2, "p2p"))
        loaded = dist_checkpointing.load(
            {"model": model.sharded_state_dict()}, str(Path(path) / "iter_0000000")
        )
        model.load_state_dict(loaded["model"], strict=True)
        rank = ps.get_tensor_model_parallel_rank()
        return [
            name
            for name, p in model.named_parameters()
            if not torch.equal(p.detach(), W.tp_shard(name, full[name], p, 2, rank))
        ]


def test_converted_checkpoint_loads_under_tp2_cp2(pool4, tmp_path):
    from megatron_video.models.qwen_vl.convert import hf_to_checkpoint

    cfg = qcfg.tiny_hf_config()
    hf = _hf_folder(tmp_path / "hf", cfg)
    hf_to_checkpoint(tmp_path / "hf", tmp_path / "c")
    full = W.to_megatron(hf.state_dict(), cfg)
    assert pool4.run(_load_converted, str(tmp_path / "c"), full) == [[]] * 4
