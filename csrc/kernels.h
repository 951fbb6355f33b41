// Raw-pointer interface of the megatron_video kernels: the boundary between torch (bindings.cpp)
// and the kernels. Plain C++ only, so the .cu files compile with nvcc against plain CUDA (no torch
// CUDA headers, which CPU wheels lack) and the CPU kernels compile against ATen/Parallel.h alone.
#pragma once
#include <cstdint>

namespace mv {

// `count` blocks of `block_bytes` each; block i is read at src + i*src_stride and written at
// dst + i*dst_stride (strides in bytes). One segment per SP rank: halo scatter and halo gather
// are both a list of such segments, executed in one pass.
struct CopySegment {
  const char* src;
  char* dst;
  int64_t count;
  int64_t block_bytes;
  int64_t src_stride;
  int64_t dst_stride;
};

// Token identities for mask construction: four int64 rows of length `len`, each contiguous.
struct TokenIds {
  const int64_t* side;   // 0 clean, 1 noisy
  const int64_t* block;  // frame // frames_per_block
  const int64_t* doc;    // document id (packing)
  const int64_t* pos;    // position (causal rule)
  int64_t len;
};

// Rule codes; megatron_video/ops/masks.py keeps the same numbering.
enum Rule : int { kFull = 0, kCausal = 1, kBlockCausal = 2, kTeacherForcing = 3 };

struct MaskSpec {
  int rule;
  bool same_doc;  // AND the rule with doc_q == doc_k
};

// Per-tile min/max of each identity row: [side, block, doc, pos] x [min, max], and the block range
// of the tile's clean (0) and noisy (1) tokens separately (lo > hi: the tile has none of that side).
struct TileSummary {
  int64_t lo[4];
  int64_t hi[4];
  int64_t side_block_lo[2];
  int64_t side_block_hi[2];
};

// CPU kernels (at::parallel_for).
void segment_copy_cpu(const CopySegment* segs, int num_segs);
void dense_mask_cpu(TokenIds q, TokenIds k, MaskSpec spec, bool* out);
// status: [ceil(q.len/q_tile), ceil(k.len/k_tile)] uint8, 0 empty / 1 partial / 2 full.
void block_status_cpu(TokenIds q, TokenIds k, MaskSpec spec, int64_t q_tile, int64_t k_tile,
                      uint8_t* status);

// CUDA launchers: enqueue on `stream` (a cudaStream_t), never synchronise; return nullptr or the
// CUDA error string of the launch. `q_sum`/`k_sum` are device scratch of one TileSummary per tile.
const char* segment_copy_cuda(const CopySegment* segs, int num_segs, void* stream);
const char* dense_mask_cuda(TokenIds q, TokenIds k, MaskSpec spec, bool* out, void* stream);
const char* block_status_cuda(TokenIds q, TokenIds k, MaskSpec spec, int64_t q_tile,
                              int64_t k_tile, TileSummary* q_sum, TileSummary* k_sum,
                              uint8_t* status, void* stream);

}  // namespace mv
