"""Imported first by ``WorkerPool``'s forkserver: where the pool's owner holds back the known
environment warnings (``training.console.quiet_known_warnings``, e.g. a benchmark script), its
workers hold them back too, without a line of their own (the owner's console says it once)."""

import os

from megatron_video.training.console import QUIET_ENV, VERBOSE_ENV, quiet_known_warnings

if os.environ.get(QUIET_ENV) == "1" and os.environ.get(VERBOSE_ENV) != "1":
    quiet_known_warnings(console=False)
