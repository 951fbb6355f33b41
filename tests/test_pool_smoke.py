import pytest
import torch.distributed as dist

from megatron_video.testing import RankError


def _rank_and_env():
    import os

    return dist.get_rank(), os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return dist.get_rank()


def _hang_unless_rank0():
    # rank 0 returns, others wait on a collective that rank 0 never joins
    if dist.get_rank() != 0:
        dist.barrier()
    return 0


def test_pool_runs_and_reports(pool4):
    out = pool4.run(_rank_and_env)
    assert [o[0] for o in out] == [0, 1, 2, 3]
    assert [o[1] for o in out] == ["2"] * 4
    assert [o[2] for o in out] == ["0", "1", "0", "1"]
    out = pool4.run(_rank_and_env, ranks_per_node=4)
    assert [o[2] for o in out] == ["0", "1", "2", "3"]


def test_pool_reraises_rank_traceback():
    from megatron_video.testing import WorkerPool

    with WorkerPool(2) as pool:
        with pytest.raises(RankError, match="boom on rank 1"):
            pool.run(_fail_on_rank1)
        # the pool restarts after a failure
        assert [o[0] for o in pool.run(_rank_and_env)] == [0, 1]


def test_pool_times_out_instead_of_hanging():
    from megatron_video.testing import WorkerPool

    with WorkerPool(2, timeout=8, gloo_timeout=60) as pool:
        with pytest.raises(RankError, match="did not finish"):
            pool.run(_hang_unless_rank0)


_KEPT = []  # groups a careless case keeps alive past its end


def _leave_groups(kept: int, stray: int):
    """``kept`` groups referenced after the case (their gloo devices stay alive) and ``stray``
    groups only left registered; returns this worker's pid."""
    import os

    for _ in range(kept):
        _KEPT.append(dist.new_group([0, 1]))
    for _ in range(stray):
        dist.new_group([0, 1])
    return os.getpid()


def _pid():
    import os

    return os.getpid()


def test_pool_sheds_leftover_groups():
    """Groups a case leaves registered are destroyed after it; workers that still hold more gloo
    devices than ``max_loop_threads`` (idle, each polls every 10 ms) are replaced. A gloo loop
    thread names itself once it runs, so on a loaded machine a worker's count after a case can
    miss threads just started: the kept devices are counted again after the next case, and the
    workers are replaced then at the latest."""
    from megatron_video.testing import WorkerPool

    with WorkerPool(2) as pool:
        first = pool.run(_leave_groups, 0, 12)
        assert pool.run(_pid) == first  # destroyed: the same workers carry on
        kept = pool.run(_leave_groups, pool.max_loop_threads + 1, 0)
        assert kept == first
        pool.run(_pid)  # counted by the case above or by this one
        assert not set(pool.run(_pid)) & set(first)  # restarted
