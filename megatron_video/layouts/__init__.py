from .balanced_sp import (  # noqa: F401
    BalancedSPLayout,
    check_whole_blocks,
    max_over_mean,
    naive_identity_units,
    naive_slice_global_ids,
    ring_attention_work,
    single_gpu_teacher_forcing_mask,
    teacher_forcing_rule,
)
from .geometry import VideoGeometry  # noqa: F401
from .mmsp import (  # noqa: F401
    FrameShards,
    ReshardPlan,
    SequenceLayout,
    causal_work,
    frame_shards,
    position_sources,
    reshard_plan,
    sequence_layout,
    visual_targets,
)
from .packed_video import PACKED_KINDS, PackedVideo, VideoClip  # noqa: F401
from .placement import (  # noqa: F401
    Clip,
    CostModel,
    Placement,
    PlacementPlan,
    plan_placement,
)
from .stdit import (  # noqa: F401
    check_stdit_divisibility,
    frames_per_rank,
    image_batch_range,
    layout_a_indices,
    layout_a_owner,
    layout_b_indices,
    layout_b_owner,
    padded_positions,
    positions_per_rank,
    shard_layout_a,
    shard_layout_b,
    token_thw,
    unshard_layout_a,
)
from .vae_halo import (  # noqa: F401
    HaloWindow,
    halo_for_lookback,
    halo_window,
    halo_windows,
    num_raw_frames,
    temporal_lookback,
    window_tensors,
    windows_for_bounds,
)
from .zigzag import (  # noqa: F401
    SCHEMES,
    concat_global_ids,
    contiguous_global_ids,
    global_token_ids,
    shard_global_ids,
    shard_owner,
    shard_sequence,
    unshard_sequence,
    zigzag_global_ids,
)
