"""Multi-modal sequence parallelism (LongVILA's MM-SP) for long-video understanding.

Stage 1 shards every video's frames over the CP group for the vision encoder + projector; stage 2
re-shards the interleaved text + visual sequence into the LLM's zigzag CP layout with one autograd
all-to-all-v (``parallel.comm.all_to_all_v``). Index maps: ``layouts.mmsp``. Megatron drop-in:
``mmsp.llava.MMSPLLaVAModel`` (imported lazily: it needs megatron-core's multimodal package).
GRPO under CP (MR-SP): ``mmsp.rl``.
Qwen2.5-VL with MM-SP: ``mmsp.qwen_vl.MMSPQwenVLModel`` (imported lazily, like ``llava``).
"""

from .sharding import MMSPBatch, encode_local, global_token_loss, plan_batch, reshard_to_llm

__all__ = ["MMSPBatch", "encode_local", "global_token_loss", "plan_batch", "reshard_to_llm"]
