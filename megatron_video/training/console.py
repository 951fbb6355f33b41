"""A quiet console: Megatron's, torch's and diffusers' known environment warnings (Transformer
Engine / Apex missing on CPU, deprecations inside Megatron-Core and torch we cannot act on; a
few known log records, ``KNOWN_LOG_RECORDS``) are
held back and announced in ONE line, on the console rank only; ``--verbose`` (or
``MEGATRON_VIDEO_VERBOSE=1``) shows them in full. Any other warning is shown as usual; ranks
that log to files (launch.py) keep every warning in their logs.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import List

__all__ = [
    "KNOWN_WARNINGS",
    "KNOWN_LOG_RECORDS",
    "quiet_known_warnings",
    "hidden_warnings",
    "VERBOSE_ENV",
    "QUIET_ENV",
    "quiet_script",
]

VERBOSE_ENV = "MEGATRON_VIDEO_VERBOSE"
_ANNOUNCED_ENV = "MEGATRON_VIDEO_WARNINGS_ANNOUNCED"  # the launcher said it: its ranks do not
QUIET_ENV = "MEGATRON_VIDEO_QUIET"  # set by quiet_known_warnings: worker pools started later agree

# (message start, what it is): the one list of warnings hidden by default
KNOWN_WARNINGS = (
    ("Transformer Engine and Apex are not installed", "Transformer Engine / Apex not installed"),
    ("Apex is not installed", "Transformer Engine / Apex not installed"),
    ("full scope is deprecated", "Megatron's cuda_graph_scope deprecation"),
    ("`load_state_dict` is deprecated", "torch.distributed.checkpoint deprecations"),
    ("Please use DTensor instead", "torch.distributed.checkpoint deprecations"),
)
# (logger, message start, what): known log records, held back the same way
KNOWN_LOG_RECORDS = (
    ("torch.utils.cpp_extension", "No CUDA runtime is found", "no CUDA runtime (CPU)"),
    (
        "megatron.core.models.multimodal.llava_model",
        "LLaVA is work in progress",
        "Megatron's LLaVA work-in-progress notice",
    ),
)
_hidden: List[str] = []


def _known(message) -> bool:
    text = str(message)
    return any(text.startswith(start) for start, _ in KNOWN_WARNINGS)


def hidden_warnings() -> List[str]:
    """The warnings held back in this process so far (formatted as Python shows them)."""
    return list(_hidden)


def quiet_known_warnings(verbose: bool = False, console: bool = True) -> None:
    """Hold back ``KNOWN_WARNINGS`` in this process (unless ``verbose``); on the ``console``
    process the first one held back prints the one line saying so (once per launch)."""
    if verbose or os.environ.get(VERBOSE_ENV) == "1":
        os.environ[VERBOSE_ENV] = "1"  # the ranks it starts show them too
        return
    if getattr(warnings.showwarning, "_megatron_video", False):
        return
    os.environ[QUIET_ENV] = "1"  # WorkerPool's forkserver reads it (testing/quiet_workers.py)
    show = warnings.showwarning

    def hold(text: str) -> None:
        _hidden.append(text)
        if console and not os.environ.get(_ANNOUNCED_ENV):
            os.environ[_ANNOUNCED_ENV] = "1"
            kinds = dict.fromkeys(
                [w for _, w in KNOWN_WARNINGS] + [r[2] for r in KNOWN_LOG_RECORDS]
            )
            print(
                f"[megatron-video] known environment warnings hidden ({', '.join(kinds)}); "
                f"--verbose shows them",
                file=sys.stderr,
                flush=True,
            )

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not _known(message):
            return show(message, category, filename, lineno, file, line)
        hold(warnings.formatwarning(message, category, filename, lineno, line))

    def record_filter(start: str):
        def keep(record: logging.LogRecord) -> bool:
            if str(record.getMessage()).startswith(start):
                hold(f"{record.name}: {record.getMessage()}")
                return False
            return True

        return keep

    for name, start, _ in KNOWN_LOG_RECORDS:
        logging.getLogger(name).addFilter(record_filter(start))
    showwarning._megatron_video = True
    warnings.showwarning = showwarning


def quiet_script(argv=None) -> bool:
    """A script's first call (``benchmarks/*.py``): hold back the known warnings unless
    ``--verbose`` is among its arguments (each script's parser documents the flag); returns it."""
    verbose = "--verbose" in (sys.argv[1:] if argv is None else argv)
    quiet_known_warnings(verbose)
    return verbose
