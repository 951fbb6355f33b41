"""Shared fixtures: worker pools of 4 and 8 gloo ranks; the compiled extension (``extension``).

The pools are session-scoped: started once (from a forkserver with torch and megatron preloaded)
and shared by every test module; each ``pool.run`` resets Megatron / topology state afterwards, and
a pool that saw a failure or a timeout is killed and restarted on its next use.
"""

import json
import os

import pytest
import torch

from megatron_video.testing import WorkerPool
from megatron_video.testing.mrsp_case import llm_weight_sum

# the one_env mark and --no-megatron; the mutation check (MEGATRON_VIDEO_MUTATIONS=1)
pytest_plugins = ["megatron_video.testing.env_split", "megatron_video.testing.mutation_plugin"]

# intra-op threads of this process: up to 2; MEGATRON_VIDEO_TEST_THREADS overrides (.ci/run sets 1:
# its two environments run at once on 2 cores, and 2 OpenMP threads each oversubscribe them)
torch.set_num_threads(
    int(os.environ.get("MEGATRON_VIDEO_TEST_THREADS", max(1, min(2, os.cpu_count() or 1))))
)


@pytest.fixture(scope="session")
def pool4():
    """4 ranks simulated as 2 nodes x 2 ranks (override per call with ``ranks_per_node=``)."""
    pool = WorkerPool(4, ranks_per_node=2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool8():
    """8 ranks simulated as 2 nodes x 4 ranks (override per call with ``ranks_per_node=``)."""
    pool = WorkerPool(8, ranks_per_node=4)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def extension():
    """The compiled module; its absence fails the tests using it unless the build was switched off."""
    try:
        import megatron_video._C as ext
    except ImportError as exc:
        if os.environ.get("MEGATRON_VIDEO_BUILD_EXT") == "0":
            pytest.skip(
                "extension not built (MEGATRON_VIDEO_BUILD_EXT=0); reference path covered elsewhere"
            )
        raise AssertionError(f"megatron_video._C is not importable: {exc}") from exc
    return ext


def _train_video_llava(path: str, output: str) -> None:
    import warnings

    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    over = [f"output={output}", "train.steps=1", "train.sample=false", "train.tensorboard=false"]
    over += ["train.warmup_steps=0"]  # the one step moves the weights (init_from's check)
    t = Trainer(load_config(path, over), progress=False)
    try:
        seed = llm_weight_sum(t.model)
        t.run()
        return dict(seed=seed, trained=llm_weight_sum(t.model))
    finally:
        t.close()


@pytest.fixture(scope="session")
def video_llava_sft(pool4, tmp_path_factory):
    """One supervised step of ``examples/configs/video_llava.yaml`` (U2xR2 on ``pool4``), trained
    once per test run: the checkpoint the GRPO tests start from (``model.init_from``)."""
    from pathlib import Path

    out = tmp_path_factory.mktemp("video_llava_sft") / "run"
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "video_llava.yaml"
    weights = pool4.run(_train_video_llava, str(config), str(out))[0]
    (out.parent / "llm_weight_sum.json").write_text(json.dumps(weights))  # init_from's check
    return out
