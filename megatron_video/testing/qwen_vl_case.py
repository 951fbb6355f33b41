"""Qwen2.5-VL test helpers of tests/test_qwen_vl.py, shared with tests/test_grpo_qwen_vl.py."""

from __future__ import annotations

import torch

VID = 91


def _rmsnorm_in_input_dtype(self, x):
    """transformers' ``Qwen2_5_VLRMSNorm.forward``, computing in float64 for float64 input."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


def token_type_ids(ids):
    return (ids == VID).int() * 2  # mm_token_type_ids: text 0, video 2
