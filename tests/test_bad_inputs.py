"""The counted bad-input suite: every row is one bad input and the parameter its error must name.

Categories: config (``validate`` and the CLI), layouts, masks, tensors (``dist_attention`` on 4
gloo ranks, explicit ``scheme=``), MM-SP (``MMSPLLaVAModel`` on 4 ranks), checkpoints, data. Each
row asserts ``ValueError`` (exit status 2 for the CLI) and that the message names the parameter;
the rule's wording is free. ``test_bad_input_count`` keeps the table at >= 25 rows across all seven
categories (docs/reliability.md, "Bad input", lists them).
"""

import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_video.testing.configs import tiny_config
from megatron_video.testing.parallel import video_parallel

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


# ---------------------------------------------------------------------------------------------
# config: validate() on the tiny job with one field changed (world of 4 ranks)
# ---------------------------------------------------------------------------------------------
def _config_case(change, parallel=None):
    def run(tmp):
        from megatron_video.training.config import validate

        cfg = tiny_config("ar_dit", str(tmp), **(parallel or {}))
        section, field, value = change
        setattr(getattr(cfg, section), field, value)
        validate(cfg, 4)

    return run


def _wan22_case(**change):
    """A Wan 2.2 VAE folder (``config.json`` alone: validate reads no weights) with ``change``
    to its keys, ``vae.latent_channels`` 48, ``data.height`` 32 unless changed."""

    def run(tmp):
        import json

        from megatron_video.testing.wan import WAN22_VAE_KEYS
        from megatron_video.training.config import validate

        keys = dict(WAN22_VAE_KEYS, z_dim=48, dim_mult=[1, 2, 2, 2])
        keys.update({k: v for k, v in change.items() if k != "height"})
        (tmp / "vae").mkdir()
        (tmp / "vae" / "config.json").write_text(json.dumps(keys))
        cfg = tiny_config("ar_dit", str(tmp))
        cfg.vae.diffusers, cfg.vae.latent_channels = str(tmp / "vae"), 48
        cfg.data.height = cfg.data.width = change.get("height", 32)
        validate(cfg, 4)

    return run


CP4 = dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2)
CONFIG = {
    "halo_latents": (_config_case(("vae", "halo_latents", "soon")), "vae.halo_latents"),
    "halo_latents_negative": (_config_case(("vae", "halo_latents", -1)), "vae.halo_latents"),
    "wan22_height": (_wan22_case(height=40), "data.height (40)"),
    "wan22_stride": (_wan22_case(scale_factor_spatial=8), "scale_factor_spatial (8)"),
    "wan22_channels": (_wan22_case(in_channels=10), "in_channels (10)"),
    "wan22_z": (_wan22_case(z_dim=16), "vae.latent_channels (48)"),
    "family": (_config_case(("model", "family", "unet")), "model.family"),
    "hidden_vs_heads": (_config_case(("model", "hidden_size", 50)), "model.hidden_size"),
    "patch_rank": (_config_case(("model", "patch_size", [1, 1])), "model.patch_size"),
    "u_times_r": (_config_case(("parallel", "ulysses_size", 4), CP4), "parallel.ulysses_size"),
    "placement": (_config_case(("parallel", "placement", "diagonal")), "parallel.placement"),
    "ring_inner_balance": (
        _config_case(("parallel", "placement", "ring_inner"), dict(CP4, ranks_per_node=4)),
        "parallel.ring_balance",
    ),
    "ring_inner_node": (
        _config_case(("parallel", "placement", "ring_inner"), dict(CP4, ring_balance=False)),
        "parallel.context_parallel_size",
    ),
    "num_frames": (_config_case(("data", "num_frames", 14)), "data.num_frames"),
    "height": (_config_case(("data", "height", 20)), "data.height"),
    "cfg_dropout": (_config_case(("diffusion", "cfg_dropout", 1.5)), "diffusion.cfg_dropout"),
    "min_lr": (_config_case(("train", "min_lr", 1.0)), "train.min_lr"),
    "global_batch": (_config_case(("train", "global_batch_size", 6)), "train.global_batch_size"),
    "nonfinite_policy": (
        _config_case(("train", "nonfinite_policy", "ignore")),
        "train.nonfinite_policy",
    ),
    "rank_timeout": (_config_case(("train", "rank_timeout_s", 0)), "train.rank_timeout_s"),
    "max_skipped": (_config_case(("train", "max_skipped_steps", 0)), "train.max_skipped_steps"),
}


def _unknown_field(tmp):
    from megatron_video.training.config import load_config

    load_config(None, ["model.widht=3"])


def _missing_yaml(tmp):
    from megatron_video.training.config import load_config

    load_config(str(tmp / "nope.yaml"))


CONFIG.update(
    {
        "unknown_field": (_unknown_field, "model: unknown field"),
        "missing_yaml": (_missing_yaml, "config"),
    }
)


# ---------------------------------------------------------------------------------------------
# layouts (pure, rank-explicit)
# ---------------------------------------------------------------------------------------------
def _shard(**kw):
    def run(tmp):
        from megatron_video.layouts import shard_sequence

        args = dict(x=torch.zeros(1, 16, 2), dim=1, scheme="zigzag", cp_rank=0, cp_size=2)
        args.update(kw)
        shard_sequence(args.pop("x"), **args)

    return run


def _balanced(**kw):
    def run(tmp):
        from megatron_video.layouts.balanced_sp import BalancedSPLayout

        args = dict(num_latent_frames=8, tokens_per_frame=4, frames_per_block=1, sp_size=4)
        args.update(kw)
        BalancedSPLayout(*args.values())

    return run


def _halo(start, end, halo):
    def run(tmp):
        from megatron_video.layouts.vae_halo import halo_window

        halo_window(start, end, halo)

    return run


def _unshard_empty(tmp):
    from megatron_video.layouts import unshard_sequence

    unshard_sequence([])


LAYOUTS = {
    "shard_dim": (_shard(dim=5), "dim"),
    "shard_scheme": (_shard(scheme="diagonal"), "scheme"),
    "shard_seq_len": (_shard(x=torch.zeros(1, 6, 2), cp_size=4), "seq_len"),
    "shard_rank": (_shard(cp_rank=2), "cp_rank"),
    "unshard_empty": (_unshard_empty, "shards"),
    "balanced_frames": (_balanced(num_latent_frames=6), "num_latent_frames"),
    "balanced_sp": (_balanced(sp_size=0), "sp_size"),
    "halo_end": (_halo(4, 4, 1), "latent_end"),
    "halo_negative": (_halo(0, 4, -1), "halo_latents"),
}


# ---------------------------------------------------------------------------------------------
# masks (public constructors)
# ---------------------------------------------------------------------------------------------
def _mask(name, *args, **kw):
    def run(tmp):
        from megatron_video.attention import masks

        getattr(masks, name)(*args, **kw)

    return run


MASKS = {
    "block_tokens": (_mask("block_causal", 0), "block_tokens"),
    "packed_order": (_mask("packed", [0, 5, 3]), "cu_seqlens"),
    "packed_start": (_mask("packed", [2, 5]), "cu_seqlens"),
    "packed_inner": (_mask("packed", [0, 4], inner="causal"), "inner"),
    "predicate_fn": (_mask("predicate", 42), "fn"),
    "predicate_scheme": (
        _mask("predicate", lambda q, k: q >= k, default_scheme="diagonal"),
        "default_scheme",
    ),
}


# ---------------------------------------------------------------------------------------------
# checkpoints and data
# ---------------------------------------------------------------------------------------------
def _no_tracker(tmp):
    from megatron_video.training import checkpoint as ckpt

    ckpt.load_checkpoint(tmp, None, None, None)


def _bad_tracker(tmp):
    from megatron_video.training import checkpoint as ckpt

    (tmp / ckpt.TRACKER_FILE).write_text("release")
    ckpt.latest_step(tmp)


def _missing_iteration(tmp):
    from megatron_video.training import checkpoint as ckpt

    ckpt.load_checkpoint(tmp, None, None, None, step=7)


def _crafted_index(tmp):
    from megatron_video.training import checkpoint as ckpt

    (tmp / ".metadata").write_bytes(pickle.dumps(_Payload(str(tmp / "pwned"))))
    try:
        ckpt.safe_read_index(tmp)
    finally:
        assert not (tmp / "pwned").exists(), "the payload ran"


def _crafted_common_state(layers: int):
    """megatron-core >= 0.19 keeps the common state as a pickled object inside the torch_dist files
    (torch's default load planner would unpickle it unrestricted); a crafted one, stored raw
    (``layers=1``) or wrapped once more in a ``BytesIO`` as torch's save planner does (``layers=2``),
    must be refused without running."""

    def run(tmp):
        import torch.distributed.checkpoint as dcp

        from megatron_video.training import checkpoint as ckpt

        class _Raw(dcp.DefaultSavePlanner):  # writes the object's bytes as given
            def transform_object(self, write_item, obj):
                return obj

        payload = io.BytesIO(pickle.dumps([_Payload(str(tmp / "pwned"))]))
        dcp.save(
            {"weight": torch.zeros(3), ckpt._COMMON_STATE_KEY: payload},
            storage_writer=dcp.FileSystemWriter(str(tmp)),
            no_dist=True,
            planner=_Raw() if layers == 1 else None,
        )
        try:
            ckpt.safe_read_common(tmp, ckpt.safe_read_index(tmp))
        finally:
            assert not (tmp / "pwned").exists(), "the payload ran"

    return run


def _crafted_vae(tmp):
    from megatron_video.training.vae_stage import load_vae

    torch.save({"state_dict": {}, "latent_scale": _Payload(str(tmp / "pwned"))}, tmp / "vae.pt")
    try:
        load_vae(tmp / "vae.pt")
    finally:
        assert not (tmp / "pwned").exists(), "the payload ran"


def _shard_with(tmp, entries):
    path = tmp / "bad-000000.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(f"000000000.{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    from megatron_video.data.shards import ShardReader

    return list(ShardReader(str(path)))


def _npy_bytes(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def _pickled_shard_entry(tmp):
    try:
        _shard_with(
            tmp, {"latent.pyd": pickle.dumps(_Payload(str(tmp / "pwned"))), "caption.txt": b"x"}
        )
    finally:
        assert not (tmp / "pwned").exists(), "the payload ran"


def _object_npy(tmp):
    arr = np.empty(1, dtype=object)
    arr[0] = _Payload(str(tmp / "pwned"))
    try:
        _shard_with(tmp, {"latent.npy": _npy_bytes(arr), "caption.txt": b"x"})
    finally:
        assert not (tmp / "pwned").exists(), "the payload ran"


def _reader(**kw):
    def run(tmp):
        from megatron_video.data.shards import ShardReader, write_shards

        write_shards([{"latent": np.zeros((1, 2, 2, 2), np.float32), "caption": "c"}], tmp)
        ShardReader(str(tmp), **kw)

    return run


def _write_bad_sample(tmp):
    from megatron_video.data.shards import write_shards

    write_shards([{"caption": "no data"}], tmp)


CHECKPOINTS = {
    "no_tracker": (_no_tracker, "latest_checkpointed_iteration.txt"),
    "bad_tracker": (_bad_tracker, "latest_checkpointed_iteration.txt"),
    "missing_iteration": (_missing_iteration, "iter_0000007"),
    "crafted_index": (_crafted_index, "checkpoint index"),
    "crafted_common_state": (_crafted_common_state(1), "common state"),
    "crafted_common_state_wrapped": (_crafted_common_state(2), "common state"),
}
DATA = {
    "crafted_vae": (_crafted_vae, "vae.weights"),
    "pickled_shard_entry": (_pickled_shard_entry, "entry 'latent.pyd'"),
    "object_npy": (_object_npy, "entry 'latent.npy'"),
    "reader_dp_rank": (_reader(dp_rank=2, dp_size=2), "dp_rank"),
    "reader_split": (_reader(split="rows"), "split"),
    "write_sample": (_write_bad_sample, "sample 0"),
}


def _mmsp_layout(fn, *args):
    def run(tmp):
        from megatron_video.layouts import mmsp

        getattr(mmsp, fn)(*args)

    return run


LAYOUTS.update(
    {
        "mmsp_frames_below_cp": (_mmsp_layout("frame_shards", [8, 3], 4), "num_frames[1]"),
        "mmsp_tubelet_split": (_mmsp_layout("frame_shards", [6, 5], 2, 2), "num_frames[1]"),
        "mmsp_tokens_per_video": (
            _mmsp_layout("sequence_layout", torch.tensor([[1, -200, 2, -200]]), -200, [4], 2),
            "tokens_per_video",
        ),
    }
)

PROCESS_FREE = {
    "config": CONFIG,
    "layouts": LAYOUTS,
    "masks": MASKS,
    "checkpoints": CHECKPOINTS,
    "data": DATA,
}
ROWS = [
    (f"{cat}/{name}", fn, param)
    for cat, table in PROCESS_FREE.items()
    for name, (fn, param) in table.items()
]


@pytest.mark.parametrize("name, fn, param", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, fn, param, tmp_path):
    with pytest.raises(ValueError) as e:
        fn(tmp_path)
    assert param in str(e.value), f"{name}: {e.value}"


# ---------------------------------------------------------------------------------------------
# tensors: dist_attention on 4 ranks (U2 x R2), explicit scheme, errors on every rank, no hang
# ---------------------------------------------------------------------------------------------
def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


TENSORS = {
    "q_rank3": (lambda r: (_t(1, 4, 4), _t(1, 4, 4, 8), _t(1, 4, 4, 8)), {}, "q"),
    "kv_shapes": (lambda r: (_t(1, 4, 4, 8), _t(1, 4, 4, 8), _t(1, 4, 2, 8)), {}, "k"),
    "dtypes": (
        lambda r: (_t(1, 4, 4, 8), _t(1, 4, 4, 8), _t(1, 4, 4, 8, dtype=torch.float64)),
        {},
        "dtypes",
    ),
    "softmax_scale": (lambda r: (_t(1, 4, 4, 8),) * 3, {"softmax_scale": -1.0}, "softmax_scale"),
    "zigzag_odd": (lambda r: (_t(1, 3, 4, 8),) * 3, {}, "s_local"),
    "backend": (lambda r: (_t(1, 4, 4, 8),) * 3, {"backend": "cudnn9"}, "backend"),
    "rank_dependent": (lambda r: (_t(1, 4 + 2 * (r == 3), 4, 8),) * 3, {}, "shape"),
}


def _tensor_row(name):
    import torch.distributed as dist

    from megatron_video.attention import dist_attention, masks

    make, kw, _ = TENSORS[name]
    with video_parallel(2, 2) as groups:
        q, k, v = make(dist.get_rank())
        try:
            dist_attention(q, k, v, groups, mask=masks.causal(), scheme="zigzag", **kw)
            out = None
        except ValueError as e:
            out = str(e)
        dist.barrier()
    return out


@pytest.mark.parametrize("name", list(TENSORS))
def test_bad_tensor_inputs(pool4, name):
    param = TENSORS[name][2]
    for rank, out in enumerate(pool4.run(_tensor_row, name)):
        assert out is not None, f"{name}: no ValueError on rank {rank}"
        assert param in out, f"{name} on rank {rank}: {out}"


# ---------------------------------------------------------------------------------------------
# MM-SP on Megatron's LLaVA model (4 ranks, U2 x R2): errors on every rank before any collective
# ---------------------------------------------------------------------------------------------
def _mmsp_forward(frames, tiles=None, n_tokens=None):
    def run(model):
        ids = torch.arange(1, 13).view(1, 12)
        for i in range(len(frames) if n_tokens is None else n_tokens):
            ids[0, 2 + 4 * i] = -200
        images = torch.zeros(sum(frames), 3, 8, 8)
        model(
            images,
            ids,
            torch.arange(12)[None],
            None,
            num_image_tiles=torch.tensor(frames if tiles is None else tiles),
        )

    return run


MMSP = {
    "frames_below_cp": (_mmsp_forward([8, 3]), "num_frames[1]"),
    "image_tokens_vs_tiles": (_mmsp_forward([4, 4], n_tokens=1), "num_image_tiles"),
    "tiles_vs_images": (_mmsp_forward([4, 4], tiles=[4, 5]), "num_image_tiles"),
    "heads_vs_ulysses": ("heads", "num_attention_heads"),
    "te_free_core_attention": ("spec", "core_attention"),
}


def _mmsp_rows():
    import torch.distributed as dist

    from megatron_video.compat import initialize_model_parallel
    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model

    initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    model = video_llava_model(VideoLLaVASizes(), cp=4, cp_comm_type="a2a+p2p")
    out = {}
    for name, (fn, _param) in MMSP.items():
        try:
            if fn == "heads":
                m = video_llava_model(
                    VideoLLaVASizes(hidden_size=24, num_attention_heads=3, num_query_groups=3),
                    cp=4,
                    cp_comm_type="a2a+p2p",
                )
                _mmsp_forward([4])(m)
            elif fn == "spec":
                video_llava_model(
                    VideoLLaVASizes(), cp=4, cp_comm_type="a2a+p2p", two_d_attention=False
                )
            else:
                fn(model)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        dist.barrier()
    return out


def test_bad_mmsp_inputs(pool4):
    for rank, out in enumerate(pool4.run(_mmsp_rows)):
        for name, (_, param) in MMSP.items():
            assert out[name] is not None, f"{name}: no ValueError on rank {rank}"
            assert param in out[name], f"{name} on rank {rank}: {out[name]}"


def test_bad_input_cli_exit_status(capsys):
    """``megatron-video validate`` returns 2 naming the field (the process's exit status is
    ``main``'s: tests/test_training_run.py::test_bad_config_fails_before_collectives)."""
    from megatron_video.training import cli

    args = ["validate", "--config", str(ROOT / "examples/configs/demo.yaml"), "--nproc", "4"]
    assert cli.main(args + ["train.nonfinite_policy=maybe"]) == 2
    assert "train.nonfinite_policy ('maybe')" in capsys.readouterr().err


def test_bad_input_count():
    counts = {cat: len(t) for cat, t in PROCESS_FREE.items()}
    counts["tensors"] = len(TENSORS)
    counts["mmsp"] = len(MMSP)
    counts["cli"] = 1
    assert sum(counts.values()) >= 25 and all(counts.values()), counts
