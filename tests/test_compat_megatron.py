"""CPU mode and feature detection (megatron_video.compat) against Megatron-Core on 4 gloo ranks.

Each multi-rank case compares Megatron running in CPU mode with an oracle computed on the same rank:
TP=2 against TP=1 with the same weights, DDP + Megatron's optimizer against a hand-built AdamW step
on DP-averaged gradients, recomputation against no recomputation, a checkpoint reload against the
saved state, a PP=2 schedule against the composed two-stage model, RNG streams against
first-principles generators. The last tests check the pure helpers in this process.
"""

import math
import multiprocessing
import os
import queue
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_video.compat import (
    accepted_kwargs,
    accepts_var_kwargs,
    call_with_accepted_kwargs,
    cpu_functions,
    cpu_optimizer_config_kwargs,
    cpu_transformer_config_kwargs,
    destroy_model_parallel,
    initialize_model_parallel,
)
from megatron_video.compat.cpu_torch import CPU_TORCH, to_cpu_device
from megatron_video.training.checkpoint import _may_fork_writers

H, HEADS, FFN, S, B = 16, 4, 32, 8, 2


# --------------------------------------------------------------------------------------------
# Helpers run on the ranks
# --------------------------------------------------------------------------------------------
class SimpleCoreAttention(torch.nn.Module):
    """Plain-softmax core attention with Megatron's core-attention signature (TP-local heads)."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type=None,
        softmax_scale=None,
        **kwargs,
    ):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        from megatron.core.transformer.enums import AttnMaskType

        sq, b, h, d = query.shape
        scale = self.softmax_scale or d**-0.5
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
        if (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal:
            future = torch.ones(sq, key.shape[0], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        elif attention_mask is not None:  # Megatron's convention: True = masked out
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bhst,tbhd->sbhd", probs, value).reshape(sq, b, h * d)


def _config(tp=1, dtype=torch.float64, dropout=0.0, **kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        **cpu_transformer_config_kwargs(
            num_layers=kw.pop("num_layers", 1),
            hidden_size=H,
            num_attention_heads=HEADS,
            ffn_hidden_size=FFN,
            tensor_model_parallel_size=tp,
            hidden_dropout=dropout,
            attention_dropout=dropout,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            **kw,
        )
    )


def _layer_spec(core_attention=SimpleCoreAttention):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def _layer(config, core_attention=SimpleCoreAttention):
    from megatron.core.transformer.spec_utils import build_module

    # Megatron's torch LayerNorm ignores params_dtype; cast so float64 cases are float64 throughout
    return build_module(_layer_spec(core_attention), config=config, layer_number=1).to(
        config.params_dtype
    )


def _shard(name, full, param, tp_rank, tp_size):
    """This TP rank's piece of a full (TP=1) tensor, split where Megatron marks the parameter."""
    if getattr(param, "tensor_model_parallel", False):
        assert param.partition_stride == 1, name
        return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
    return full


def _load_full(module, full_state, tp_rank, tp_size):
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(_shard(name, full_state[name], p, tp_rank, tp_size))


def _init(**kw):
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel()  # also frees the gloo groups, which Megatron 0.16 leaks
    initialize_model_parallel(**kw)


def _randn(seed, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --------------------------------------------------------------------------------------------
# Rank functions
# --------------------------------------------------------------------------------------------
def _tp_layer_matches_tp1():
    """TransformerLayer TP=2 (x DP=2) == TP=1 with the same weights: outputs and all gradients."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    dp_index = dist.get_rank() // 2  # Megatron's order tp-cp-ep-dp-pp: TP is fastest
    x0, dy = _randn(10 + dp_index, S, B, H), _randn(20 + dp_index, S, B, H)

    _init(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    torch.manual_seed(0)
    ref = _layer(_config(tp=1))
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    x = x0.clone().requires_grad_()
    y_ref = ref(x, attention_mask=None)[0]
    y_ref.backward(dy)
    x_grad_ref, grads_ref = x.grad, {n: p.grad for n, p in ref.named_parameters()}

    _init(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    tp_rank = ps.get_tensor_model_parallel_rank()
    for core in (SimpleCoreAttention, None):  # None: Megatron's own DotProductAttention
        layer = _layer(_config(tp=2), core_attention=core)
        _load_full(layer, full, tp_rank, 2)
        x = x0.clone().requires_grad_()
        y = layer(x, attention_mask=None)[0]
        y.backward(dy)
        assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        assert_close(x.grad, x_grad_ref, rtol=1e-10, atol=1e-10)
        for name, p in layer.named_parameters():
            expected = _shard(name, grads_ref[name], p, tp_rank, 2)
            assert_close(p.grad, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return sum(1 for p in layer.parameters() if getattr(p, "tensor_model_parallel", False))


def _rng_tracker_streams():
    """Forked streams follow Megatron's documented seeds and leave the default stream alone: the
    user's CPU generator is neither reseeded by model_parallel_cuda_manual_seed nor advanced."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_data_parallel_rng_tracker_name

    _init(tensor_model_parallel_size=2)
    seed = 1234
    torch.manual_seed(99)  # the user's own seed
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default = torch.Generator().manual_seed(99)  # continues untouched
    model_parallel = torch.Generator().manual_seed(
        seed + 2718 + ps.get_tensor_model_parallel_rank()
    )
    data_parallel = torch.Generator().manual_seed(seed)

    d1 = torch.rand(4)
    with tracker.fork():
        m1 = torch.rand(4)
    d2 = torch.rand(4)
    with tracker.fork():
        m2 = torch.rand(4)
    with tracker.fork(get_data_parallel_rng_tracker_name()):
        p1 = torch.rand(4)
    for got, gen in (
        (d1, default),
        (d2, default),
        (m1, model_parallel),
        (m2, model_parallel),
        (p1, data_parallel),
    ):
        assert torch.equal(got, torch.rand(4, generator=gen))
    return m1


def _recompute_matches_plain():
    """Activation checkpointing with dropout on reproduces the plain forward/backward exactly."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.transformer_block import TransformerBlock

    _init(tensor_model_parallel_size=2)
    x0, dy = _randn(1, S, B, H), _randn(2, S, B, H)
    runs = {}
    for name, seed, kw in (
        ("plain", 7, {}),
        ("other_seed", 8, {}),
        (
            "full",
            7,
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        ),
    ):
        torch.manual_seed(0)  # same weights in every run
        block = TransformerBlock(
            _config(tp=2, dropout=0.3, num_layers=2, **kw), spec=_layer_spec(None)
        ).double()
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)  # the default (hidden-dropout) stream is the user's on CPU
        x = x0.clone().requires_grad_()
        y = block(x, attention_mask=None)
        y.backward(dy)
        runs[name] = (y.detach(), x.grad, [p.grad for p in block.parameters()])
    assert not torch.equal(runs["plain"][0], runs["other_seed"][0]), "dropout had no effect"
    for a, b in zip(
        runs["plain"][:2] + tuple(runs["plain"][2]), runs["full"][:2] + tuple(runs["full"][2])
    ):
        assert torch.equal(a, b)

    # tensor_parallel.checkpoint directly, dropout inside the model-parallel stream
    def f(t):
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(t.sin(), 0.5)

    grads = []
    for use_ckpt in (False, True):
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        t = x0.clone().requires_grad_()
        out = tensor_parallel.checkpoint(f, False, t) if use_ckpt else f(t)
        out.backward(dy)
        grads.append((out.detach(), t.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    return True


_OPT = dict(
    optimizer="adam",
    lr=1e-2,
    weight_decay=0.1,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_eps=1e-3,
    clip_grad=0.05,
)  # eps ~ grad size: no sign amplification of fp noise


def _reference_adam(full, grads_per_step):
    """Hand-built AdamW on DP-averaged, globally clipped gradients.

    Weight decay applies to every parameter: Megatron's per-group ``wd_mult`` (no decay for biases
    and norms) is applied by ``OptimizerParamScheduler``, which this step does not use.
    """
    params = {n: t.clone().requires_grad_() for n, t in full.items()}
    opt = torch.optim.AdamW(
        list(params.values()),
        lr=_OPT["lr"],
        weight_decay=_OPT["weight_decay"],
        betas=(_OPT["adam_beta1"], _OPT["adam_beta2"]),
        eps=_OPT["adam_eps"],
    )
    norms = []
    for grads in grads_per_step:
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        coeff = min(1.0, _OPT["clip_grad"] / (norm + 1e-6))
        for n, p in params.items():
            p.grad = grads[n] * coeff
        opt.step()
        norms.append(norm)
    return {n: p.detach() for n, p in params.items()}, norms


def _ddp_optimizer(layer, config):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), layer)
    opt = get_megatron_optimizer(OptimizerConfig(**cpu_optimizer_config_kwargs(**_OPT)), [ddp])
    return ddp, opt


def _train_step(ddp, opt, x, dy):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(x, attention_mask=None)[0].backward(dy)
    ddp.finish_grad_sync()
    ok, norm, _ = opt.step()
    assert ok
    return norm


def _step_data(step, dp_index):
    return _randn(100 * step + dp_index, S, B, H, dtype=torch.float32), _randn(
        100 * step + 50 + dp_index, S, B, H, dtype=torch.float32
    )


def _ddp_optimizer_matches_reference():
    """DDP (TP=2 x DP=2) + Megatron optimizer with clipping == AdamW on averaged clipped grads."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    dp_index, steps = dist.get_rank() // 2, 2
    _init(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    torch.manual_seed(0)
    ref = _layer(_config(tp=1, dtype=torch.float32))
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    grads_per_step = []
    for step in range(steps):  # gradients of both DP ranks' data at the reference's weights
        if step:
            ref_state, _ = _reference_adam(full, grads_per_step)
            _load_full(ref, ref_state, 0, 1)
        acc = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
        for d in range(2):
            ref.zero_grad()
            x, dy = _step_data(step, d)
            ref(x, attention_mask=None)[0].backward(dy)
            for n, p in ref.named_parameters():
                acc[n] += p.grad / 2
        grads_per_step.append(acc)
    expected, ref_norms = _reference_adam(full, grads_per_step)
    assert all(n > _OPT["clip_grad"] for n in ref_norms), "clipping must be active to be tested"

    _init(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    tp_rank = ps.get_tensor_model_parallel_rank()
    config = _config(tp=2, dtype=torch.float32)
    layer = _layer(config)
    _load_full(layer, full, tp_rank, 2)
    ddp, opt = _ddp_optimizer(layer, config)
    for step in range(steps):
        norm = _train_step(ddp, opt, *_step_data(step, dp_index))
        assert math.isclose(norm, ref_norms[step], rel_tol=1e-5), (norm, ref_norms[step])
    for name, p in layer.named_parameters():
        assert_close(
            p.detach(),
            _shard(name, expected[name], p, tp_rank, 2),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"{name}: {m}",
        )
    return ref_norms


def _checkpoint_round_trip(ckpt_dir):
    """dist_checkpointing save/load of model + optimizer state: identical after reload and after
    one more identical step."""
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _init(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    dp_index = ps.get_data_parallel_rank()
    config = _config(tp=2, dtype=torch.float32)
    models = []
    for seed in (0, 1):  # the second model starts from different weights and an empty optimizer
        torch.manual_seed(seed)
        layer = _layer(config)
        models.append((layer, *_ddp_optimizer(layer, config)))
    (layer, ddp, opt), (layer2, ddp2, opt2) = models
    for step in range(2):
        _train_step(ddp, opt, *_step_data(step, dp_index))

    model_sd = layer.sharded_state_dict()
    with _may_fork_writers():  # our save path: forks allowed, a thread results queue
        dist_checkpointing.save(
            {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, ckpt_dir
        )
    # the writer's results came through a thread queue: no spawned Manager outlives the save
    assert isinstance(filesystem_async._results_queue, queue.Queue)
    assert not multiprocessing.active_children(), multiprocessing.active_children()
    model_sd2 = layer2.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_sd2, "optimizer": opt2.sharded_state_dict(model_sd2, is_loading=True)},
        ckpt_dir,
    )
    layer2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])

    def flat_state(o):
        return [(k, v) for p in o.get_parameters() for k, v in sorted(o.optimizer.state[p].items())]

    for (n, p), (_, p2) in zip(layer.named_parameters(), layer2.named_parameters()):
        assert torch.equal(p, p2), n
    state, state2 = flat_state(opt), flat_state(opt2)
    assert len(state) == len(state2) > 0
    for (k, v), (k2, v2) in zip(state, state2):
        assert k == k2 and torch.equal(torch.as_tensor(v), torch.as_tensor(v2)), k
    batch = _step_data(2, dp_index)
    assert _train_step(ddp, opt, *batch) == _train_step(ddp2, opt2, *batch)
    for p, p2 in zip(layer.parameters(), layer2.parameters()):
        assert torch.equal(p, p2)
    return len(state)


class _Stage(torch.nn.Module):
    """One pipeline stage: tanh(linear(x)) on [s, b, h]; reads its input from the previous stage."""

    def __init__(self, config, stage):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config, self.model_type, self.input_tensor = config, ModelType.encoder_or_decoder, None
        self.linear = torch.nn.Linear(H, H, dtype=torch.float64)
        with torch.no_grad():
            self.linear.weight.copy_(_randn(300 + stage, H, H) / 4)
            self.linear.bias.copy_(_randn(400 + stage, H))

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        return torch.tanh(self.linear(x if self.input_tensor is None else self.input_tensor))


def _pipeline_matches_composed_model():
    """A PP=2 (x DP=2) 1F1B schedule == the two stages composed on one process: losses, grads."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _init(pipeline_model_parallel_size=2)
    stage, dp_index, n_mb = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(), 4
    config = _config(dtype=torch.float64, pipeline_model_parallel_size=2, num_layers=2)
    model = _Stage(config, stage)
    batches = [_randn(500 + 10 * dp_index + m, S, B, H) for m in range(n_mb)]

    def loss_func(out):
        loss = out.pow(2).mean()
        return loss, {"loss": loss.detach().clone()}  # Megatron divides ``loss`` in place

    def forward_step(data_iterator, module):
        return module(next(data_iterator)), loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=n_mb,
        seq_length=S,
        micro_batch_size=B,
        forward_only=False,
    )

    stages = [_Stage(config, s) for s in (0, 1)]
    ref_losses = [loss_func(stages[1](stages[0](x)))[0] for x in batches]
    (sum(ref_losses) / n_mb).backward()  # Megatron divides each microbatch loss by their number
    for p, p_ref in zip(model.parameters(), stages[stage].parameters()):
        assert_close(p.grad, p_ref.grad, rtol=1e-10, atol=1e-12)
    if ps.is_pipeline_last_stage():
        assert_close(torch.stack([d["loss"] for d in losses]), torch.stack(ref_losses).detach())
    else:
        assert losses == [] or losses is None or all(not d for d in losses)
    return stage


def _rope_cp_slices():
    """Megatron's RoPE with CP > 1 returns zigzag chunks c and 2N-1-c of the full embedding."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    seq, out = 16, []
    for cp in (2, 4):
        _init(context_parallel_size=cp)
        rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
        full = rope.get_emb(seq)
        c, chunk = ps.get_context_parallel_rank(), seq // (2 * cp)
        expected = torch.cat(
            [
                full[c * chunk : (c + 1) * chunk],
                full[(2 * cp - 1 - c) * chunk : (2 * cp - c) * chunk],
            ]
        )
        got = rope(seq, cp_group=ps.get_context_parallel_group())
        assert torch.equal(got, expected), (cp, c)
        out.append(got.shape[0])
    return out


# --------------------------------------------------------------------------------------------
# Multi-rank tests (pool4: 4 ranks, 2 simulated nodes x 2)
# --------------------------------------------------------------------------------------------
def test_transformer_layer_tp2_matches_tp1(pool4):
    n_split = pool4.run(_tp_layer_matches_tp1)
    assert all(n >= 4 for n in n_split)  # QKV, proj, fc1, fc2 weights (+ biases) really split


def test_rng_tracker_streams(pool4):
    draws = pool4.run(_rng_tracker_streams)
    # TP ranks 0/1 differ in the model-parallel stream; DP replicas (rank r, r+2) agree
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])


def test_activation_recompute_matches_plain(pool4):
    assert pool4.run(_recompute_matches_plain) == [True] * 4


def test_ddp_optimizer_step_with_clipping(pool4):
    norms = pool4.run(_ddp_optimizer_matches_reference)
    assert all(n == norms[0] for n in norms)


def test_dist_checkpointing_round_trip(pool4, tmp_path):
    (tmp_path / "ckpt").mkdir()
    counts = pool4.run(_checkpoint_round_trip, str(tmp_path / "ckpt"))
    assert all(c > 0 for c in counts)
    assert any((tmp_path / "ckpt").iterdir())


def test_pipeline_schedule_pp2(pool4):
    assert sorted(pool4.run(_pipeline_matches_composed_model)) == [0, 0, 1, 1]


def test_rope_context_parallel(pool4):
    assert pool4.run(_rope_cp_slices) == [[8, 4]] * 4


# --------------------------------------------------------------------------------------------
# Single-process tests
# --------------------------------------------------------------------------------------------
_GPU_FLAG_SCRIPT = r"""
import importlib, torch
from megatron_video.compat import cpu_mode
modules = [importlib.import_module(m) for m, _ in cpu_mode.MODULES_USING_CUDA]
originals = {(m, a): getattr(importlib.import_module(m), a) for m, a, _ in cpu_mode.FUNCTION_PATCHES}
assert cpu_mode._activate(cuda_available=True) is False
assert not cpu_mode.cpu_mode_active() and cpu_mode.applied_patches() == ()
assert all(m.torch is torch for m in modules)
assert all(getattr(importlib.import_module(m), a) is f for (m, a), f in originals.items())
assert cpu_mode._activate(cuda_available=False) is True
n = len(cpu_mode.applied_patches())
assert n == (len(cpu_mode.MODULES_USING_CUDA) + len(cpu_mode.FUNCTION_PATCHES)
             + len(cpu_mode.SEEDING_FUNCTIONS)), n
assert all(m.torch is not torch for m in modules)
assert cpu_mode._activate(cuda_available=False) and len(cpu_mode.applied_patches()) == n
assert cpu_mode._activate(cuda_available=True) is False  # a GPU flag never patches or unpatches
print("ok")
"""


def test_cpu_mode_is_noop_with_cuda_and_idempotent():
    # A fresh interpreter: this process may already have CPU mode active.
    out = subprocess.run(
        [sys.executable, "-c", _GPU_FLAG_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_cpu_torch_view():
    assert CPU_TORCH.zeros(2, device="cuda").device.type == "cpu"
    assert CPU_TORCH.tensor([1], device="cuda:1", pin_memory=True).device.type == "cpu"
    assert CPU_TORCH.empty(1, device=CPU_TORCH.cuda.current_device()).device.type == "cpu"
    assert CPU_TORCH.Tensor is torch.Tensor and CPU_TORCH.float is torch.float
    assert CPU_TORCH.cuda.is_available() is torch.cuda.is_available()
    CPU_TORCH.cuda.synchronize()
    assert [to_cpu_device(d) for d in ("cuda", 0, torch.device("cuda", 1), "meta", None)] == [
        torch.device("cpu")
    ] * 3 + [torch.device("meta"), None]
    state = CPU_TORCH.cuda.get_rng_state()
    a = torch.rand(3)
    CPU_TORCH.cuda.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    CPU_TORCH.cuda.manual_seed(11)
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(11)))


def test_cpu_rng_functions():
    state = cpu_functions.get_rng_state()
    a = torch.rand(5)
    cpu_functions.set_rng_state(state)
    assert torch.equal(a, torch.rand(5))
    with pytest.raises(RuntimeError, match="use_cudagraphable_rng"):
        cpu_functions.get_rng_state(graph_safe=True)


def test_cpu_clip_matches_torch():
    grads = [torch.randn(4, 3) for _ in range(3)]

    def with_grads():
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return params

    ours, theirs = with_grads(), with_grads()
    total = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))  # same rule: max / (norm + 1e-6)
    assert total > 1.0
    cpu_functions.clip_grad_by_total_norm_fp32(ours, 1.0, total)
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad)
    before = [p.grad.clone() for p in ours]
    cpu_functions.clip_grad_by_total_norm_fp32(ours, 10.0, 1.0)  # below the limit: unchanged
    assert all(torch.equal(p.grad, g) for p, g in zip(ours, before))
    half = torch.nn.Parameter(torch.randn(2).half())
    half.grad = torch.randn(2).half()
    with pytest.raises(TypeError, match="float32"):
        cpu_functions.clip_grad_by_total_norm_fp32([half], 1.0, 2.0)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("seq_dim", [0, 1])
def test_cpu_pos_emb_on_cp_rank(cp_size, seq_dim):
    seq = 24
    emb = torch.arange(seq * 3.0).reshape(seq, 3).movedim(0, seq_dim).unsqueeze(-1)
    chunk = seq // (2 * cp_size)
    for c in range(cp_size):
        group = types.SimpleNamespace(size=lambda: cp_size, rank=lambda c=c: c)
        got = cpu_functions.get_pos_emb_on_this_cp_rank(emb, seq_dim, group)
        ids = list(range(c * chunk, (c + 1) * chunk)) + list(
            range((2 * cp_size - 1 - c) * chunk, (2 * cp_size - c) * chunk)
        )
        assert torch.equal(got, emb.index_select(seq_dim, torch.tensor(ids)))


def test_feature_detection_helpers():
    def f(a, b=1):
        return a + b

    def g(a, **kwargs):
        return kwargs

    assert accepted_kwargs(f, {"a": 1, "c": 2}) == ({"a": 1}, {"c": 2})
    assert accepted_kwargs(g, {"z": 1}) == ({"z": 1}, {})
    assert accepts_var_kwargs(g) and not accepts_var_kwargs(f)
    assert accepts_var_kwargs(SimpleCoreAttention.forward)
    assert call_with_accepted_kwargs(f, a=1, b=2, unknown=None, off=False, one=1) == 3
    with pytest.raises(ValueError, match=r"unknown \(2\).*not supported"):
        call_with_accepted_kwargs(f, a=1, unknown=2)
    with pytest.raises(ValueError, match=r"flag \(True\)"):
        call_with_accepted_kwargs(f, a=1, flag=True)
    # raised before Megatron is called, so no process group is needed
    with pytest.raises(ValueError, match=r"made_up_parallel_size \(2\)"):
        initialize_model_parallel(tensor_model_parallel_size=1, made_up_parallel_size=2)


def test_cpu_config_kwargs():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        **cpu_transformer_config_kwargs(
            num_layers=1, hidden_size=8, num_attention_heads=2, bf16=False
        )
    )
    assert cfg.use_cpu_initialization and not cfg.gradient_accumulation_fusion
    assert not cfg.bias_activation_fusion and not cfg.masked_softmax_fusion
    assert cfg.params_dtype == torch.float32
    assert (
        cpu_transformer_config_kwargs(params_dtype=torch.float64)["params_dtype"] == torch.float64
    )
    with pytest.raises(TypeError):  # misspelt model arguments still fail in Megatron
        TransformerConfig(
            **cpu_transformer_config_kwargs(
                num_layers=1, hidden_size=8, num_attention_heads=2, hiden_size=8
            )
        )
    opt = OptimizerConfig(**cpu_optimizer_config_kwargs(lr=1e-3))
    assert not opt.use_distributed_optimizer and opt.lr == 1e-3 and not opt.bf16


_EXPLICIT_CPU_MODE_SCRIPT = r"""
import logging, os, io
import torch, torch.distributed as dist
log = io.StringIO()
logging.basicConfig(stream=log, level=logging.WARNING, format="%(levelname)s %(message)s")
logging.getLogger("megatron_video.compat").setLevel(logging.DEBUG)  # the list of patches is DEBUG
from megatron_video.compat import cpu_mode_active, ensure_cpu_mode
from megatron_video.training.config import load_config
from megatron_video.training.trainer import Trainer
assert not cpu_mode_active()  # importing the package (trainer included) enters nothing
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
try:
    Trainer(load_config("examples/configs/demo.yaml", []))
    raise SystemExit("the trainer ran without CUDA and without CPU mode")
except RuntimeError as e:
    assert "no CUDA device" in str(e) and "--cpu" in str(e), e
torch.manual_seed(99)
expected = torch.rand(3, generator=torch.Generator().manual_seed(99))
assert ensure_cpu_mode() and cpu_mode_active()
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
ps.initialize_model_parallel()
model_parallel_cuda_manual_seed(1234)  # must not reseed the user's CPU generator
assert torch.equal(torch.rand(3), expected)
text = log.getvalue()
from megatron_video.compat.cpu_mode import applied_patches
warning = [l for l in text.splitlines() if l.startswith("WARNING megatron_video CPU mode")]
assert len(warning) == 1 and len(warning[0]) < 400, text  # one short line at WARNING
assert f"{len(applied_patches())} Megatron attributes replaced" in warning[0], text
assert "CPU RNG state changed within GPU RNG context" in warning[0], text  # the dropped record is named
listed = [l for l in text.splitlines() if l.startswith("DEBUG megatron_video CPU mode replaced")]
assert len(listed) == 1 and "model_parallel_cuda_manual_seed" in listed[0], text  # the list, at DEBUG
assert any(p.attribute == "model_parallel_cuda_manual_seed" for p in applied_patches())
print("ok")
"""


def test_cpu_mode_is_explicit_logged_and_keeps_the_users_generator():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PORT=str(port), PYTHONPATH=str(root))
    out = subprocess.run(
        [sys.executable, "-c", _EXPLICIT_CPU_MODE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=env,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_transformer_config_follows_the_device():
    """``has_gpu`` chooses init device and fusions (no GPU needed to build the config)."""
    from megatron_video.training.config import load_config
    from megatron_video.training.model_factory import transformer_config

    cfg = load_config("examples/configs/demo.yaml", [])
    cpu, gpu = transformer_config(cfg, has_gpu=False), transformer_config(cfg, has_gpu=True)
    assert (
        cpu.use_cpu_initialization and not cpu.masked_softmax_fusion and not cpu.bias_dropout_fusion
    )
    assert not gpu.use_cpu_initialization and gpu.masked_softmax_fusion and gpu.bias_dropout_fusion
    assert (
        gpu.params_dtype
        == cpu.params_dtype
        == (torch.bfloat16 if cfg.train.bf16 else torch.float32)
    )
