from .zigzag import (SCHEMES, concat_global_ids, contiguous_global_ids, global_token_ids,  # noqa: F401
                     shard_global_ids, shard_owner, shard_sequence,
                     unshard_sequence, zigzag_global_ids)
from .geometry import VideoGeometry  # noqa: F401
from .stdit import (check_stdit_divisibility, frames_per_rank,  # noqa: F401
                    image_batch_range, layout_a_indices, layout_a_owner, layout_b_indices,
                    layout_b_owner, padded_positions, positions_per_rank, shard_layout_a,
                    shard_layout_b, token_thw, unshard_layout_a)
from .balanced_sp import (BalancedSPLayout, max_over_mean, naive_identity_units,  # noqa: F401
                          naive_slice_global_ids, ring_attention_work, single_gpu_teacher_forcing_mask,
                          teacher_forcing_rule)
from .vae_halo import (HaloProbe, HaloWindow, encoder_halo, encoder_temporal_ops,  # noqa: F401
                       halo_for_lookback, halo_window, halo_windows, num_raw_frames, probe_halo,
                       resolve_halo, temporal_lookback, temporal_receptive_field, window_tensors,
                       windows_for_bounds)
from .mmsp import (FrameShards, ReshardPlan, SequenceLayout, causal_work, frame_shards,  # noqa: F401
                   position_sources, reshard_plan, sequence_layout, visual_targets)
