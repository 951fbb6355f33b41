"""Shipped GRPO rewards for multiple-choice, numeric and short text answers (``rl.reward:
module:function``).

The rules are Long-RL's R1-V reward (NVlabs/Long-RL, examples/reward_function/r1v.py): the format
score is 1 when the whole response is ``<think>...</think> <answer>...</answer>``; the answer is
the content of ``<answer>...</answer>`` with spaces and newlines removed (the whole stripped
response when there is none); the reward is ``(1 - format_weight) * accuracy + format_weight *
format`` (``format_weight`` 0.1). Long-RL grades the answer with ``mathruler``'s symbolic
``grade_answer``; here a multiple-choice answer is graded by its option letter and a numeric one
by its value (relative tolerance 1e-6), a text answer (a word, e.g. a colour) by its text with
case and spaces ignored, without a symbolic-math dependency.

The token-level functions take ``(tokens [G, L], lengths [G])`` as every ``rl.reward`` does, plus
the sample's ``answer`` (the ground truth as text) and ``decode`` (token ids -> text, the
tokenizer's); other sample fields are ignored. A caller that does not pass them gets a
``ValueError`` naming the function (``mmsp.rl.score``).
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "format_score",
    "extract_answer",
    "choice_accuracy",
    "numeric_accuracy",
    "text_accuracy",
    "choice_reward",
    "numeric_reward",
    "text_reward",
]

FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>")
CHOICE = re.compile(r"^\(?([A-Za-z])(?:[).:]|$)")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def format_score(response: str) -> float:
    """1.0 when the whole response is ``<think>...</think>`` then ``<answer>...</answer>``."""
    return 1.0 if FORMAT.fullmatch(response) else 0.0


def extract_answer(response: str) -> str:
    """The ``<answer>`` content, spaces and newlines removed (the stripped response if none)."""
    m = ANSWER.search(response.replace("\n", "").replace(" ", ""))
    return m.group(1).strip() if m else response.strip()


def choice_accuracy(response: str, truth: str) -> float:
    """1.0 when the answer's option letter (``B``, ``(B)``, ``B.``, ``B:`` or ``B)`` first, any
    case) is the truth's."""
    given, want = CHOICE.match(extract_answer(response)), CHOICE.match(truth.strip())
    if want is None:
        raise ValueError(f"answer ({truth!r}) must be an option letter (A, (B), C. ...)")
    return 1.0 if given and given.group(1).upper() == want.group(1).upper() else 0.0


def _number(text: str) -> Optional[float]:
    m = NUMBER.search(text.replace(",", ""))
    return float(m.group(0)) if m else None


def numeric_accuracy(response: str, truth: str, rel_tol: float = 1e-6) -> float:
    """1.0 when the answer's first number equals the truth's (``|x - y| <= rel_tol * max(1,
    |y|)``; thousands separators ignored)."""
    want = _number(truth)
    if want is None:
        raise ValueError(f"answer ({truth!r}) must hold a number")
    given = _number(extract_answer(response))
    return 1.0 if given is not None and abs(given - want) <= rel_tol * max(1.0, abs(want)) else 0.0


def text_accuracy(response: str, truth: str) -> float:
    """1.0 when the answer equals the truth with case and spaces ignored (``Red``, ``<think>..
    </think> <answer> red </answer>`` for ``red``)."""
    want = truth.replace(" ", "").replace("\n", "").lower()
    if not want:
        raise ValueError(f"answer ({truth!r}) must be a non-empty text")
    return 1.0 if extract_answer(response).replace(" ", "").lower() == want else 0.0


def _reward(accuracy, tokens, lengths, answer, decode, format_weight) -> torch.Tensor:
    if not 0 <= format_weight <= 1:
        raise ValueError(f"format_weight ({format_weight!r}) must be in [0, 1]")
    out = []
    for g in range(tokens.shape[0]):
        text = decode(tokens[g, : int(lengths[g])].tolist())
        out.append(
            (1 - format_weight) * accuracy(text, answer) + format_weight * format_score(text)
        )
    return torch.tensor(out, dtype=torch.float64)


def choice_reward(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    answer: str,
    decode: Callable[[Sequence[int]], str],
    format_weight: float = 0.1,
    **_sample,
) -> torch.Tensor:
    """Multiple choice: ``0.9 * choice_accuracy + 0.1 * format_score`` per response ``[G]``."""
    return _reward(choice_accuracy, tokens, lengths, answer, decode, format_weight)


def numeric_reward(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    answer: str,
    decode: Callable[[Sequence[int]], str],
    format_weight: float = 0.1,
    **_sample,
) -> torch.Tensor:
    """Numeric answers: ``0.9 * numeric_accuracy + 0.1 * format_score`` per response ``[G]``."""
    return _reward(numeric_accuracy, tokens, lengths, answer, decode, format_weight)


def text_reward(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    answer: str,
    decode: Callable[[Sequence[int]], str],
    format_weight: float = 0.1,
    **_sample,
) -> torch.Tensor:
    """Short text answers: ``0.9 * text_accuracy + 0.1 * format_score`` per response ``[G]``."""
    return _reward(text_accuracy, tokens, lengths, answer, decode, format_weight)
