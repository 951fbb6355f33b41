"""Save / resume with ``megatron.core.dist_checkpointing``: model, optimizer, LR scheduler, RNG, step.

Megatron-LM's layout (``<dir>/iter_0000100/``, ``<dir>/latest_checkpointed_iteration.txt``); atomic
saves (``save_checkpoint``), resume under any parallel layout that runs no code from the file
(``load_checkpoint``). Failure behaviour: docs/reliability.md.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import pickle
import random
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..compat.checkpoint_writer import use_thread_results_queue
from ..compat.manifest import MANIFEST_FILE, write_manifest
from ..compat.manifest import manifest_files as _files
from ..compat.manifest import sha256_file as _sha256
from ..parallel.comm import agree_or_raise
from ..parallel.fsdp import load_model_state, load_optimizer_state, optimizer_state_ids

__all__ = [
    "TRACKER_FILE",
    "load_model_weights",
    "read_data_state",
    "latest_step",
    "checkpoint_path",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "safe_read_index",
    "safe_read_common",
]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
DATA_STATE_DIR = "dataloader"


def checkpoint_path(directory, step: int) -> Path:
    return Path(directory) / f"iter_{step:07d}"


def latest_step(directory) -> Optional[int]:
    """Step of the newest complete checkpoint under ``directory`` (None if there is none)."""
    f = Path(directory) / TRACKER_FILE
    if not f.is_file():
        return None
    text = f.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint tracker {f} ({text!r}) must hold an iteration number")
    return int(text)


# ----------------------------------------------------------------------------------------------
# RNG states as tensors (no pickled objects in the checkpoint)
# ----------------------------------------------------------------------------------------------
def rng_state() -> Dict[str, torch.Tensor]:
    """This process's RNG states (torch, CUDA, Megatron's tracker, numpy, ``random``) as 1-D tensors."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "torch": torch.get_rng_state().clone(),
        "random": torch.tensor([version, *internal], dtype=torch.int64),
        "random_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
    }
    for name, state in sorted(get_cuda_rng_tracker().get_states().items()):
        out[f"tracker.{name}"] = state.clone().cpu()
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state().cpu()
    return out


def set_rng_state(state: Dict[str, torch.Tensor]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"].to(torch.uint8))
    r = state["random"].tolist()
    g = state["random_gauss"].tolist()
    random.setstate((int(r[0]), tuple(int(x) for x in r[1:]), g[1] if g[0] else None))
    n = state["numpy"].tolist()
    np.random.set_state(
        (
            "MT19937",
            np.array(n[:624], dtype=np.uint32),
            int(n[624]),
            int(n[625]),
            float(state["numpy_gauss"][0]),
        )
    )
    tracker = {
        k[len("tracker.") :]: v.to(torch.uint8)
        for k, v in state.items()
        if k.startswith("tracker.")
    }
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8))


def _rng_sharded(world: int, rank: int) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {
        name: ShardedTensor.from_rank_offsets(
            f"rng.{name}", t, (0, rank, world), replica_id=0, prepend_axis_num=1
        )
        for name, t in rng_state().items()
    }


# ----------------------------------------------------------------------------------------------
# Sharded state
# ----------------------------------------------------------------------------------------------
@contextmanager
def _may_fork_writers():
    """Megatron's checkpoint writer forks helper processes, which a daemonic process (e.g. a test
    worker) may not have; lift the flag for the duration of the save only. Our saves are
    synchronous: the writer's results go through a thread queue, not a spawned Manager."""
    use_thread_results_queue()
    proc = multiprocessing.current_process()
    was = proc.daemon
    proc.daemon = False
    try:
        yield
    finally:
        proc.daemon = was


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def _without_objects(sd):
    """Drop ``ShardedObject`` entries (TransformerEngine ``_extra_state``: FP8 metadata, which these
    models do not use) so that the checkpoint holds tensors and plain values only."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(sd, dict):
        return {k: _without_objects(v) for k, v in sd.items() if not isinstance(v, ShardedObject)}
    if isinstance(sd, list):
        return [_without_objects(v) for v in sd if not isinstance(v, ShardedObject)]
    return sd


def _sharded(
    model, optimizer, scheduler, step: int, is_loading: bool, with_rng: bool, meta: Optional[dict]
) -> dict:
    model_sd = _without_objects(model.sharded_state_dict())
    sd = {
        "layout": _layout(),
        "model_meta": dict(meta or {}),
        "step": step,
        "model": model_sd,
        "optimizer": _without_objects(_optimizer_sharded(optimizer, model_sd, is_loading)),
        "scheduler": scheduler.state_dict(),
    }
    if with_rng:
        sd["rng"] = _rng_sharded(dist.get_world_size(), dist.get_rank())
    return sd


def _optimizer_sharded(optimizer, model_sd, is_loading: bool) -> dict:
    with optimizer_state_ids():  # FSDP's DTensor parameters (parallel.fsdp)
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading)


def _sharded_tensors(sd) -> Dict[str, tuple]:
    """``{checkpoint key: global shape}`` of every sharded tensor requested by ``sd``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}

    def walk(x):
        if isinstance(x, ShardedTensor):
            out[x.key] = tuple(x.global_shape)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(sd)
    return out


# ----------------------------------------------------------------------------------------------
# Safe reading
# ----------------------------------------------------------------------------------------------
_DCP = "torch.distributed.checkpoint"
_INDEX_NAMES = {  # plain dataclasses / enums of a torch.distributed.checkpoint index, and torch.Size
    *(
        (f"{_DCP}.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *(
        (f"{_DCP}.planner", n)
        for n in (
            "SavePlan",
            "WriteItem",
            "WriteItemType",
            "TensorWriteData",
            "LoadPlan",
            "ReadItem",
            "LoadItemType",
        )
    ),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id (a plain value)
}


class _IndexUnpickler(pickle.Unpickler):
    """Builds only the named dataclasses of a ``torch.distributed.checkpoint`` index, torch dtypes /
    layouts / sizes and plain containers; any other global (``os.system``, ``builtins.eval``, a
    module's imported helpers, ...) is refused before it is called."""

    def find_class(self, module, name):
        if (module, name) in _INDEX_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a checkpoint index")


def safe_read_index(path) -> object:
    """The ``torch.distributed.checkpoint`` index (``.metadata``) of checkpoint ``path``, read with
    the restricted unpickler; raises ``ValueError`` for anything else in it."""
    f = Path(path) / ".metadata"
    try:
        with open(f, "rb") as fh:
            index = _IndexUnpickler(fh).load()
    except Exception as e:  # UnpicklingError, EOFError, AttributeError, ...
        raise ValueError(
            f"checkpoint index {f} is not a valid tensor index (refused, nothing executed): "
            f"{type(e).__name__}: {e}"
        ) from None
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    if not isinstance(index, Metadata):
        raise ValueError(
            f"checkpoint index {f} holds {type(index).__name__}, must be a tensor index"
        )
    objects = sorted(
        k
        for k, v in index.state_dict_metadata.items()
        if isinstance(v, BytesStorageMetadata) and k != _COMMON_STATE_KEY
    )
    if objects:
        raise ValueError(
            f"checkpoint {path} stores pickled objects {objects[:5]}: refused (a checkpoint "
            f"must hold tensors only; loading them would run arbitrary code)"
        )
    return index


# megatron-core >= 0.19 stores the common (non-tensor) state as one ShardedObject inside the
# torch_dist checkpoint (its unique key below) instead of ``common.pt``; torch's default load
# planner would unpickle it unrestricted, so its bytes are read raw and checked weights-only first.
_COMMON_STATE_KEY = "common_state/shard_0_1"


def _raw_bytes_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _RawBytes(DefaultLoadPlanner):
        """Copies BYTE_IO items raw into the caller's ``BytesIO`` (never unpickled by the planner)."""

        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn].write(value.read())

    return _RawBytes(flatten_state_dict=False)


def safe_read_common(path, index) -> dict:
    """The checkpoint's common state, read with ``torch.load(weights_only=True)``: from ``common.pt``
    (megatron-core <= 0.18) or from the torch_dist ``common_state`` object (>= 0.19)."""
    f = Path(path) / "common.pt"
    what = str(f)
    try:
        if f.exists() or _COMMON_STATE_KEY not in index.state_dict_metadata:
            return torch.load(f, map_location="cpu", weights_only=True)
        import torch.distributed.checkpoint as dcp

        what = f"{path} [{_COMMON_STATE_KEY}]"
        buf = {_COMMON_STATE_KEY: io.BytesIO()}
        dcp.load(
            buf,
            storage_reader=dcp.FileSystemReader(str(path)),
            planner=_raw_bytes_planner(),
            no_dist=True,
        )
        raw = buf[_COMMON_STATE_KEY]
        raw.seek(0)
        loaded = torch.load(raw, map_location="cpu", weights_only=True)
        if isinstance(loaded, io.BytesIO):  # a second serialisation layer (torch's default planner)
            loaded.seek(0)
            loaded = torch.load(loaded, map_location="cpu", weights_only=True)
        return loaded[0] if isinstance(loaded, (list, tuple)) else loaded
    except Exception as e:
        raise ValueError(
            f"checkpoint common state {what} is unreadable or not weights-only (refused, nothing "
            f"executed): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def _verify_share(path: Path, rank: int, world: int) -> Optional[str]:
    """Check this rank's round-robin share of the files against the manifest; a reason or None."""
    m = path / MANIFEST_FILE
    try:
        files = json.loads(m.read_text())["files"]
    except Exception as e:
        return f"manifest {m} is missing or unreadable ({type(e).__name__})"
    present = _files(path)
    if sorted(files) != present:
        return (
            f"files {sorted(set(files) ^ set(present))[:5]} differ from the manifest "
            f"(missing or extra)"
        )
    for i, name in enumerate(present):
        if i % world != rank:
            continue
        f = path / name
        if f.stat().st_size != files[name]["bytes"] or _sha256(f) != files[name]["sha256"]:
            return f"file {name} does not match the manifest (truncated or modified)"
    return None


# ----------------------------------------------------------------------------------------------
# Save / load
# ----------------------------------------------------------------------------------------------
def save_checkpoint(
    directory,
    step: int,
    model,
    optimizer,
    scheduler,
    meta: Optional[dict] = None,
    data_state: Optional[Tuple[str, str]] = None,
    extra_files: Optional[Dict[str, str]] = None,
) -> Path:
    """Collective: save everything for ``step`` atomically; returns the checkpoint folder.
    ``meta`` (the model's shape-defining configuration) is stored to explain a refused resume.
    ``data_state``: ``(name, json_text)`` this rank's data-loader state, written to
    ``dataloader/<name>.json`` (plain JSON, covered by the manifest; ``read_data_state``).
    ``extra_files``: ``{file name: JSON text}`` rank 0 writes beside the tensors (the family's
    ``checkpoint_files``), covered by the manifest.

    Atomic: the save writes ``iter_XXXXXXX.partial/``, then rank 0 writes a manifest (size and
    SHA-256 of every file), renames the folder to ``iter_XXXXXXX/`` and only then replaces the
    tracker file (temp file + ``os.replace``). A crash at any point leaves the tracker on the
    previous complete checkpoint; a leftover ``.partial`` folder is never read and is cleared by
    the next save."""
    from megatron.core import dist_checkpointing

    for name, text in (extra_files or {}).items():  # on every rank, before any collective
        if not name or "/" in name or name.startswith(".") or name == MANIFEST_FILE:
            raise ValueError(f"extra_files name ({name!r}) must be a plain file name")
        json.loads(text)  # only JSON goes into a checkpoint
    final = checkpoint_path(directory, step)
    partial = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier save
        partial.mkdir(parents=True)
    dist.barrier()
    with _may_fork_writers():
        dist_checkpointing.save(
            _sharded(model, optimizer, scheduler, step, False, True, meta), str(partial)
        )
    if data_state is not None:
        name, text = data_state
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"data_state name ({name!r}) must be a plain file name")
        json.loads(text)  # only JSON goes into a checkpoint
        (partial / DATA_STATE_DIR).mkdir(exist_ok=True)
        (partial / DATA_STATE_DIR / f"{name}.json").write_text(text)
    dist.barrier()
    if dist.get_rank() == 0:
        for name, text in (extra_files or {}).items():
            (partial / name).write_text(text)
        write_manifest(partial)
        if final.exists():  # a re-save of the same step: swap, then drop the old one
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        tracker = Path(directory) / TRACKER_FILE
        tmp = tracker.with_name(f"{TRACKER_FILE}.tmp{os.getpid()}")
        with open(tmp, "w") as fh:
            fh.write(str(step))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, tracker)
    dist.barrier()
    return final


def read_data_state(directory, step: int, name: str) -> Optional[str]:
    """This rank's data-loader state (JSON text) from checkpoint ``step``, or None if it has none
    (the file was checked against the manifest when the checkpoint was loaded)."""
    f = checkpoint_path(directory, step) / DATA_STATE_DIR / f"{name}.json"
    return f.read_text() if f.is_file() else None


def _shape_refusal(
    path, index, request: dict, saved_meta: dict, meta: Optional[dict]
) -> Optional[str]:
    saved = {k: tuple(v.size) for k, v in index.state_dict_metadata.items() if hasattr(v, "size")}
    wanted = _sharded_tensors(request)
    missing = sorted(k for k in wanted if k not in saved)
    wrong = sorted(k for k in wanted if k in saved and saved[k] != wanted[k])
    if not missing and not wrong:
        return None
    fields = sorted(
        k for k in set(saved_meta) | set(meta or {}) if saved_meta.get(k) != (meta or {}).get(k)
    )
    why = ", ".join(
        f"{k}: checkpoint {saved_meta.get(k)!r} vs job {(meta or {}).get(k)!r}" for k in fields
    )
    detail = (
        f"tensors {wrong[:3]} have shapes {[saved[k] for k in wrong[:3]]} in the checkpoint, "
        f"{[wanted[k] for k in wrong[:3]]} in this model"
        if wrong
        else f"tensors {missing[:3]} are not in the checkpoint"
    )
    return (
        f"checkpoint {path} holds a different model shape ({why or 'fields unknown'}); {detail}. "
        f"Only the parallel layout may change on resume"
    )


def load_checkpoint(
    directory, model, optimizer, scheduler, step: Optional[int] = None, meta: Optional[dict] = None
) -> int:
    """Collective: restore the newest (or the given) checkpoint under any parallel layout; returns
    its step. Raises ``ValueError`` on every rank for a missing, corrupt, unsafe or
    different-model checkpoint before anything is loaded (the outcomes travel in one all-reduce).

    Resharding: model and optimizer state are Megatron sharded tensors (global shapes with this
    rank's slice), so each rank reads the slices its new data / context (U x R) / tensor / pipeline
    layout needs. The LR scheduler counts samples, so with the global batch kept the schedule
    continues exactly. RNG states are per global rank: restored when the world size is unchanged,
    otherwise left as seeded from ``train.seed`` (the injected noise is keyed by step and sample,
    ``training/batches/``). Only a different model shape is refused, naming the fields and tensors.

    Nothing from the file runs code: every file is checked against the manifest; the common part
    is read with ``torch.load(weights_only=True)``; the tensor index (``.metadata``, a pickle of
    ``torch.distributed.checkpoint``) with an unpickler that can only build the index's own
    dataclasses; an index declaring pickled objects is refused (RNG states are stored as
    tensors)."""
    from megatron.core import dist_checkpointing

    step = latest_step(directory) if step is None else step
    if step is None:
        raise ValueError(
            f"checkpoint directory ({directory}) must hold {TRACKER_FILE} (no complete checkpoint)"
        )
    path = checkpoint_path(directory, step)
    if not path.is_dir():
        raise ValueError(f"checkpoint ({path}) must be an existing folder")
    rank, world = dist.get_rank(), dist.get_world_size()
    agree_or_raise(_verify_share(path, rank, world), f"checkpoint {path} is corrupt")
    reason, common, index = None, {}, None
    try:
        index = safe_read_index(path)
        common = safe_read_common(path, index)
    except ValueError as e:
        reason = str(e)
    agree_or_raise(reason, f"checkpoint {path} refused")
    same_world = common.get("layout", {}).get("world_size") == world
    request = _sharded(model, optimizer, scheduler, step, True, same_world, meta)
    agree_or_raise(
        _shape_refusal(path, index, request, common.get("model_meta", {}), meta), "resume refused"
    )
    loaded = dist_checkpointing.load(request, str(path))
    state = loaded["model"]
    for key, value in model.state_dict().items():  # TE extra state is not checkpointed: keep it
        if key.endswith("_extra_state") and key not in state:
            state[key] = value
    load_model_state(model, state)  # FSDP: into each parameter's shard
    load_optimizer_state(optimizer, loaded["optimizer"])
    _report_schedule_change(scheduler, loaded["scheduler"])
    scheduler.load_state_dict(loaded["scheduler"])
    if same_world:
        set_rng_state(loaded["rng"])
    if int(loaded["step"]) != step:
        raise ValueError(f"checkpoint {path} holds step {loaded['step']}, expected {step}")
    return step


_SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def _report_schedule_change(scheduler, saved: dict) -> None:
    """Name what a scheduler that overrides the checkpoint's LR schedule changes (the config's
    ``train.steps``, ``lr``, ... differ from the saved run's; steps counted in samples)."""
    if not getattr(scheduler, "override_opt_param_scheduler", False) or dist.get_rank():
        return
    changed = [
        f"{k} {saved[k]} -> {getattr(scheduler, k)}"
        for k in _SCHEDULE_KEYS
        if k in saved and saved[k] != getattr(scheduler, k)
    ]
    if changed:
        print(
            "[megatron-video] resume: the LR schedule follows the config, not the checkpoint: "
            + ", ".join(changed),
            flush=True,
        )


def load_model_weights(directory, model, step: Optional[int] = None) -> int:
    """Collective: only the model's weights of the newest (or the given) checkpoint, under any
    parallel layout (generation: no optimizer, scheduler or RNG); the same checks as
    ``load_checkpoint`` before anything is loaded. Returns the step."""
    from megatron.core import dist_checkpointing

    step = latest_step(directory) if step is None else step
    if step is None:
        raise ValueError(
            f"checkpoint directory ({directory}) must hold {TRACKER_FILE} (no complete checkpoint)"
        )
    path = checkpoint_path(directory, step)
    agree_or_raise(
        _verify_share(path, dist.get_rank(), dist.get_world_size()), f"checkpoint {path} is corrupt"
    )
    reason = None
    try:
        safe_read_common(path, safe_read_index(path))
    except ValueError as e:
        reason = str(e)
    agree_or_raise(reason, f"checkpoint {path} refused")
    request = {"model": _without_objects(model.sharded_state_dict())}
    state = dist_checkpointing.load(request, str(path))["model"]
    for key, value in model.state_dict().items():  # TE extra state is not checkpointed: keep it
        if key.endswith("_extra_state") and key not in state:
            state[key] = value
    model.load_state_dict(state)
    return step
