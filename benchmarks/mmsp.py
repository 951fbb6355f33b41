"""MM-SP (two-stage sharding) vs replicated encoding and all-reduce re-sharding (counts, not timings).

Runs ``MMSPLLaVAModel`` (FrameViT encoder, MLP projector, 2-layer GPT with 2D attention) on a gloo
pool of 4 CPU ranks (U2 x R2, 2 simulated nodes x 2) on a micro-batch of long videos, and prints
per rank:

* vision encoder + projector FLOPs (``torch.utils.flop_counter``) and saved-activation bytes (the
  tensors autograd keeps for the backward, ``saved_tensors_hooks``) of stage 1 vs every rank
  encoding every frame (Megatron-Core 0.16's ``LLaVAModel`` under CP, LongVILA without MM-SP);
* re-shard bytes per rank (tracer): the one all-to-all-v (forward + backward) vs an all-gather of
  every rank's visual tokens and vs the scheme of LongVILA's public code (VILA's
  ``llava/model/llava_arch.py``, ``repack_multimodal_data``: a zero-filled buffer and an in-place
  ``dist.all_reduce``, which has no autograd formula, so a token used on another rank sends no
  gradient back to the encoder that produced it). Here that scheme re-shards the visual tokens
  only, into our layout: VILA all-reduces the whole text + visual embedding (plus three
  ``all_gather``s), so the printed bytes understate its traffic; its encoder-gradient error is
  printed next to MM-SP's (exact: 0) and holds for our layout (with LongVILA's own sharding of a
  packed sample it is about 0.2-0.9);
* LLM tokens (non-padding) and causal attention work per rank, max/mean (target 1.00 / <= 1.05),
  for the unpacked batch and for a packed one;
* comm calls and bytes of one MM-SP forward + backward (tracer table, rank 0).

    python benchmarks/mmsp.py --frames 64 61 --text 48
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

IMG = -200


def _batch(frames, text, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (1, text), generator=g)
    step = text // (len(frames) + 1)
    for i in range(len(frames)):
        ids[0, step * (i + 1)] = IMG
    images = torch.randn(sum(frames), 3, 8, 8, generator=g)
    labels = torch.randint(0, 64, ids.shape, generator=g)
    return images, ids, labels, torch.ones(ids.shape), torch.tensor(frames, dtype=torch.int)


def _saved_bytes(fn):
    """(result, bytes of the tensors autograd saves for the backward while running ``fn``)."""
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _flops(fn):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        out = fn()
    return out, fc.get_total_flops()


def _rank(frames, text):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import initialize_model_parallel
    from megatron_video.layouts import mmsp as L
    from megatron_video.mmsp import global_token_loss
    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model
    from megatron_video.parallel import comm
    from megatron_video.parallel.comm import CommTracer

    initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    sizes = VideoLLaVASizes(max_sequence_length=4096)
    model = video_llava_model(sizes, cp=4, cp_comm_type="a2a+p2p")
    group, rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    images, ids, labels, loss_mask, tiles = _batch(frames, text)
    pos = torch.arange(text)[None]
    out = {}

    # one MM-SP step, traced
    with CommTracer() as tr:
        loss_tok, mask = model(
            images, ids, pos, None, labels=labels, loss_mask=loss_mask, num_image_tiles=tiles
        )
        global_token_loss(loss_tok.double(), mask, group).backward()
    out["table"] = tr.table()
    out["a2av"] = (tr.bytes("all_to_all_v", "fwd"), tr.bytes("all_to_all_v", "bwd"))
    out["calls"] = {k: v for k, v in tr.summary().items()}
    b = model.last_mmsp_batch
    local = b.shards.local_units(rank)

    # stage 1: this rank's frames vs all frames
    from megatron_video.mmsp import encode_local

    _, out["flops_mmsp"] = _flops(lambda: encode_local(model._encode, images, b))
    _, out["flops_repl"] = _flops(lambda: model._encode(images))
    _, out["act_mmsp"] = _saved_bytes(lambda: encode_local(model._encode, images, b))
    _, out["act_repl"] = _saved_bytes(lambda: model._encode(images))
    out["frames_mmsp"], out["frames_total"] = int(local.numel()), int(images.shape[0])

    # re-shard alternatives on the same visual tokens
    h = sizes.hidden_size
    n_vis = b.layout.visual_pos.numel()
    visual_all = torch.randn(n_vis, h, generator=torch.Generator().manual_seed(1))
    P = model.img_seq_len
    rows = (local[:, None] * P + torch.arange(P)[None]).flatten()  # source order of my tokens
    w = torch.randn(
        b.layout.batch * b.layout.local_len, h, generator=torch.Generator().manual_seed(2 + rank)
    )  # a loss on my LLM shard

    def exact_grad():
        x = visual_all[rows].clone().requires_grad_(True)
        text_rows = torch.zeros(ids.numel(), h)
        from megatron_video.mmsp import reshard_to_llm

        shard = reshard_to_llm(x, text_rows, b, group)
        (shard.reshape(-1, h) * w).sum().backward()
        return x.grad

    def allreduce_grad():  # LongVILA's scheme on our layout, visual tokens only: zero buffer +
        # in-place all_reduce, not seen by autograd (VILA also all-reduces the text rows)
        x = visual_all[rows].clone().requires_grad_(True)
        buf = torch.zeros(n_vis, h)
        buf = buf.index_put((rows,), x)
        comm.all_reduce(
            buf.data, group, tag="longvila.all_reduce"
        )  # in place, invisible to autograd
        dst, dst_local = L.visual_targets(b.layout)
        mine = torch.nonzero(dst == rank).flatten()
        shard = torch.zeros(b.layout.batch * b.layout.local_len, h).index_put(
            (dst_local[mine],), buf[mine]
        )
        (shard * w).sum().backward()
        return x.grad

    g_exact = exact_grad()
    with CommTracer() as tr2:
        g_ar = allreduce_grad()
    out["allreduce_bytes"] = tr2.bytes("all_reduce")
    err = float((g_ar - g_exact).norm()) ** 2
    ref = float(g_exact.norm()) ** 2
    t = torch.tensor([err, ref], dtype=torch.float64)
    comm.all_reduce(t, group)
    out["grad_err"] = float(t[0].sqrt() / t[1].sqrt())
    # all-gather of every rank's visual tokens (padded to the largest share)
    n_max = max(int(b.shards.counts[r].sum()) for r in range(4)) * P
    with CommTracer() as tr3:
        comm.all_gather_cat(torch.zeros(n_max, h), group, tag="allgather")
    out["allgather_bytes"] = tr3.bytes("all_gather")

    # LLM balance (pure): non-padding tokens and causal work per rank, unpacked and packed
    lay = b.layout
    from megatron_video.layouts.zigzag import shard_global_ids

    ids_local = shard_global_ids(rank, 4, lay.seq_len, "zigzag")
    out["tokens"] = int((ids_local < int(lay.lengths[0])).sum())
    out["work"] = L.causal_work(lay, rank)
    n = int(lay.lengths[0])
    cu = torch.tensor([0, n // 3, (2 * n) // 3, n])
    out["work_packed"] = L.causal_work(lay, rank, cu)
    out["seq_len"], out["n_vis"] = lay.seq_len, n_vis
    dist.barrier()
    return out


def _mm(vals):
    vals = [float(v) for v in vals]
    return max(vals) / (sum(vals) / len(vals))


def main():
    from megatron_video.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--frames", type=int, nargs="+", default=[64, 61])
    ap.add_argument("--text", type=int, default=48)
    a = ap.parse_args()
    with WorkerPool(4, ranks_per_node=2, timeout=1200) as pool:
        res = pool.run(_rank, a.frames, a.text)
    r0 = res[0]
    print(
        f"videos {a.frames} frames, 4 tokens/frame, text {a.text}; combined length "
        f"{r0['seq_len']} (padded), {r0['n_vis']} visual tokens; CP = 4 as U2 x R2 (2 nodes x 2), "
        f"hidden 32, fp32 tokens"
    )
    print(
        "\nstage 1 (vision encoder + projector) per rank: MM-SP vs every rank encoding every frame"
    )
    print(
        f"{'rank':<6}{'frames':>8}{'GFLOP mmsp':>12}{'GFLOP repl':>12}{'ratio':>8}"
        f"{'act MiB mmsp':>14}{'act MiB repl':>14}{'ratio':>8}"
    )
    for r, o in enumerate(res):
        print(
            f"{r:<6}{o['frames_mmsp']:>4}/{o['frames_total']:<3}{o['flops_mmsp'] / 1e9:>12.4f}"
            f"{o['flops_repl'] / 1e9:>12.4f}{o['flops_mmsp'] / o['flops_repl']:>8.3f}"
            f"{o['act_mmsp'] / 2**20:>14.3f}{o['act_repl'] / 2**20:>14.3f}"
            f"{o['act_mmsp'] / o['act_repl']:>8.3f}"
        )
    print(
        "\nre-shard bytes per rank (tracer): MM-SP all-to-all-v fwd + bwd | all-gather of visual "
        "tokens | zero buffer + all_reduce of the visual tokens only, forward (LongVILA's scheme; "
        "repo convention: all-reduce nbytes*(N-1)/N). VILA's code all-reduces the whole text + "
        "visual embedding and adds three all_gathers, so it moves more than this column"
    )
    print(f"{'rank':<6}{'a2av fwd':>10}{'a2av bwd':>10}{'all-gather':>12}{'all_reduce':>12}")
    for r, o in enumerate(res):
        print(
            f"{r:<6}{o['a2av'][0]:>10,}{o['a2av'][1]:>10,}{o['allgather_bytes']:>12,}"
            f"{o['allreduce_bytes']:>12,}"
        )
    print(
        f"encoder-gradient error ||g - g_exact|| / ||g_exact||: MM-SP all-to-all-v 0 (exact, "
        f"tests/test_mmsp.py), zero buffer + all_reduce {r0['grad_err']:.3f} in our layout "
        f"(dist.all_reduce has no autograd formula: tokens used on another rank send no "
        f"gradient back; with LongVILA's own sharding of a packed sample about 0.2-0.9)"
    )
    print("\nLLM balance per rank (zigzag): max/mean")
    L = res[0]["seq_len"] // 4
    print(f"tokens (with padding: what the LLM computes) {[L] * 4} -> 1.000")
    print(
        f"tokens (non-padding) {[o['tokens'] for o in res]} -> {_mm([o['tokens'] for o in res]):.3f}"
    )
    print(f"causal work          {[o['work'] for o in res]} -> {_mm([o['work'] for o in res]):.3f}")
    print(
        f"causal work, packed into 3 documents {[o['work_packed'] for o in res]} -> "
        f"{_mm([o['work_packed'] for o in res]):.3f}"
    )
    print("\ncomm of one MM-SP forward + backward, rank 0 (tracer):")
    print(r0["table"])


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
