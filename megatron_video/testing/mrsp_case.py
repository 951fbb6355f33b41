"""GRPO / MR-SP oracle cases of tests/test_mrsp.py, shared with tests/test_grpo_loss_options.py."""

from __future__ import annotations

import zlib

import torch

IMG = -200


SIZES = dict(
    vocab_size=64,
    max_sequence_length=128,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vision_layers=1,
    vision_hidden_size=16,
    vision_heads=2,
    img_size=8,
    patch_dim=4,
)


G, L, F = 4, 3, 5


def _data():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 64, (1, 6), generator=g)
    ids[0, 1] = IMG
    images = torch.randn(F, 3, 8, 8, generator=g, dtype=torch.float64)
    return images, ids


def _perturb(model, salt, scale):
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32((salt + name).encode()))
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _full(model, what):
    from megatron.core import parallel_state as ps

    from megatron_video.parallel import comm

    out, tp = {}, ps.get_tensor_model_parallel_world_size()
    for name, p in model.named_parameters():
        if what == "grad":
            t = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            if ps.get_context_parallel_world_size() > 1:
                comm.all_reduce(t, ps.get_context_parallel_group())
        else:
            t = p.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            t = comm.all_gather_cat(t, ps.get_tensor_model_parallel_group(), dim=p.partition_dim)
        out[name] = t
    return out


def _load(model, full):
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = full[name]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                v = v.chunk(tp, dim=p.partition_dim)[rank]
            p.copy_(v)


def _oracle_lp(model, images, ids, tokens, grad=False, temperature=1.0, argmax=False):
    """Megatron CP = 1 forward of prompt + each response: per-token log-probs ``[G, L]`` at the
    rollout temperature (1 for greedy); ``argmax``: also the argmax token ``[G, L]`` of the
    logits at each response position (after the response's earlier tokens) and its margin over
    the runner-up logit ``[G, L]``."""
    P = ids.shape[1] - 1 + F * model.img_seq_len
    rows, best, gap = [], [], []
    for g in range(tokens.shape[0]):
        full = torch.cat([ids, tokens[g : g + 1]], dim=1)
        pos = torch.arange(full.shape[1])[None]
        with torch.set_grad_enabled(grad):
            logits, _ = model(
                images, full, pos, None, num_image_tiles=torch.tensor([F], dtype=torch.int)
            )
            lp = torch.log_softmax(logits[0].double() / temperature, dim=-1)
            rows.append(lp[P - 1 + torch.arange(L), tokens[g]])
            top = logits[0, P - 1 + torch.arange(L)].detach().double().topk(2, dim=-1)
            best.append(top.indices[:, 0])
            gap.append(top.values[:, 0] - top.values[:, 1])
    if argmax:
        return torch.stack(rows), torch.stack(best), torch.stack(gap)
    return torch.stack(rows)


def _freeze_vision(model):
    for name, p in model.named_parameters():
        if name.startswith(("vision_model.", "vision_projection.")):
            p.requires_grad_(False)


def llm_weight_sum(model) -> float:
    """The float64 sum of a ``video_llava`` model's language-model weights (whole on every rank
    without TP): ``model.init_from``'s check that the policy starts from the supervised run."""
    llm = model.language_model
    return float(sum(p.detach().double().sum() for p in llm.parameters()))
