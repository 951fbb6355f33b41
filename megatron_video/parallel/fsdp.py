"""Fully sharded data parallelism (ZeRO-3, ``parallel.fsdp``) with PyTorch's FSDP2.

Megatron-Core's ``TorchFullyShardedDataParallel`` is the same idea, but it builds its device mesh
on CUDA only; this wrapper takes the module's device (gloo on CPU, NCCL on GPUs). Every
``TransformerLayer`` is one FSDP unit (its weights gathered just before its forward and again
before its backward, its gradients reduce-scattered after it); the rest of the model (embedders,
final layer) is the root unit. Weights, gradients and optimizer state are sharded over the data
parallel x context parallel group, the group Megatron's DDP averages gradients over, so losses
and gradients equal DDP's. Megatron's optimizer, gradient clipping and ``dist_checkpointing``
read the DTensor parameters (a checkpoint resumes under any layout, with or without FSDP).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import to_local_if_dtensor

local_tensor = to_local_if_dtensor  # this rank's shard of a DTensor: Megatron's helper

__all__ = [
    "FullyShardedDataParallel",
    "load_model_state",
    "load_optimizer_state",
    "local_tensor",
    "optimizer_state_ids",
]


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    """``model.load_state_dict(state)``, also for FSDP's DTensor parameters: ``state`` holds this
    rank's slice of each (what ``dist_checkpointing`` reads for the sharded request)."""
    own = model.state_dict(keep_vars=True)
    if not any(hasattr(t, "to_local") for t in own.values()):
        model.load_state_dict(state)
        return
    if set(own) != set(state):
        raise RuntimeError(
            f"checkpoint state and model differ: missing {sorted(set(own) - set(state))}, "
            f"unexpected {sorted(set(state) - set(own))}"
        )
    with torch.no_grad():
        for key, t in own.items():
            if isinstance(t, torch.Tensor):  # not TE's extra state (None or bytes)
                local_tensor(t).copy_(state[key])


def load_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` (a Megatron optimizer); the moments of FSDP's DTensor
    parameters are read as this rank's slices and made DTensors of the parameter's mesh again."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(state)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    continue
                moments = inner.state.get(p, {})
                for k, v in moments.items():
                    if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim():
                        moments[k] = DTensor.from_local(
                            v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                        )


def _mesh(group, device: str):
    """The device mesh of ``group``. Torch's DTensor caches compare meshes by ranks, device and
    dimension names, and would hand a later trainer's DTensors the mesh of an earlier, destroyed
    group of the same ranks (a second trainer in one process); the dimension is named after the
    group (torch names each new group uniquely), so a mesh equals only the meshes of its group."""
    from torch.distributed import DeviceMesh

    return DeviceMesh.from_group(group, device, mesh_dim_names=(f"fsdp_{group.group_name}",))


@contextmanager
def optimizer_state_ids():
    """While Megatron maps optimizer state to checkpoint entries: its sharded-tensor helpers keep a
    DTensor parameter's ``_local_tensor`` and its map looks parameters up by ``id(to_local())``,
    which this torch returns as a fresh alias (no entry would match). The map then looks up
    ``_local_tensor`` itself, what Megatron means; a no-op where Megatron has no such map."""
    import megatron.core.dist_checkpointing.optimizer as m

    original = getattr(m, "to_local_if_dtensor", None)
    if original is not None:
        m.to_local_if_dtensor = lambda t: getattr(t, "_local_tensor", t)
    try:
        yield
    finally:
        if original is not None:
            m.to_local_if_dtensor = original


class FullyShardedDataParallel(_BaseDataParallel):
    """``module`` sharded over ``group`` (``fully_shard`` per ``TransformerLayer``, then the root).

    ``ddp_config`` is kept for Megatron's optimizer (it reads ``use_distributed_optimizer``, which
    must be False: FSDP already shards the optimizer state). Gradients are reduced in fp32.
    """

    def __init__(self, config, ddp_config, module: torch.nn.Module, group):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if ddp_config.use_distributed_optimizer:
            raise ValueError(
                "ddp_config.use_distributed_optimizer (True) must be False with FSDP "
                "(it shards the optimizer state already)"
            )
        super().__init__(config=config, module=module)
        self.ddp_config = ddp_config
        self.process_group = group
        mesh = _mesh(group, next(module.parameters()).device.type)
        kwargs = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        # fully_shard replaces each parameter: keep Megatron's attributes on them (tensor_model_
        # parallel, partition_dim, sequence_parallel, ...), which the optimizer and grad
        # finalisation read
        attrs = {name: dict(vars(p)) for name, p in module.named_parameters()}
        # Megatron's checkpoint offsets assume equal shards of dim 0: a parameter whose dim 0 the
        # group does not split evenly (a tiny vocabulary, an odd bias) stays replicated, its
        # gradient all-reduced here as DDP does
        n = group.size()
        self.replicated = [p for p in module.parameters() if p.dim() == 0 or p.shape[0] % n]
        kwargs["ignored_params"] = set(self.replicated)
        for sub in module.modules():
            if isinstance(sub, TransformerLayer):
                fully_shard(sub, **kwargs)
        fully_shard(module, **kwargs)
        for name, p in module.named_parameters():
            for key, value in attrs.get(name, {}).items():
                setattr(p, key, value)
            if hasattr(p, "to_local"):  # Megatron's mark of an FSDP2 shard (its checkpoint offsets)
                p.is_torch_fsdp2_param = True
        # Megatron's gradient norm sums every rank's part over the group once any gradient is a
        # DTensor: a replicated gradient counts on the group's first rank only ("shared": counted
        # elsewhere, as Megatron marks its tied embeddings)
        if group.rank() > 0 and len(self.replicated) < sum(1 for _ in module.parameters()):
            for p in self.replicated:
                p.shared = True

    def finish_grad_sync(self, *args, **kwargs) -> None:
        """Average the replicated parameters' gradients (in fp32); FSDP reduce-scattered the
        others during the backward. (``finalize_model_grads`` passes arguments the base class
        does not take.)"""
        from .comm import all_reduce

        grads = [p.grad for p in self.replicated if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.float().reshape(-1) for g in grads])  # one collective for all
        all_reduce(flat, self.process_group, tag="fsdp.replicated_grads")
        flat /= self.process_group.size()
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
