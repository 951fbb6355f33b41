// CUDA segment copy: one launch per 32 ranks (in practice one launch), segments passed by value
// as kernel parameters (no host->device copy, no synchronisation). blockIdx.z picks the rank,
// blockIdx.y the block, and threads copy 16/8/4/2/1-byte words, the widest that every address,
// stride and length of the launch is aligned to. Byte copies: exact for every dtype.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace mv {
namespace {

constexpr int kMaxSegs = 32;  // 32 x 48 B of parameters, well under the 4 KiB limit
constexpr int kThreads = 256;

struct SegBatch {
  CopySegment seg[kMaxSegs];
};

template <typename V>
__global__ void segment_copy_kernel(SegBatch batch) {
  const CopySegment s = batch.seg[blockIdx.z];
  const int64_t words = s.block_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = blockIdx.y; b < s.count; b += gridDim.y) {
    const V* src = reinterpret_cast<const V*>(s.src + b * s.src_stride);
    V* dst = reinterpret_cast<V*>(s.dst + b * s.dst_stride);
    for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += step) {
      dst[w] = src[w];
    }
  }
}

template <typename V>
void launch(const SegBatch& batch, int n, int64_t max_words, int64_t max_count, cudaStream_t stream) {
  const int64_t gx = std::min<int64_t>((max_words + kThreads - 1) / kThreads, 1 << 16);
  const int64_t gy = std::min<int64_t>(max_count, 65535);
  segment_copy_kernel<V><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy), n), kThreads, 0, stream>>>(batch);
}

}  // namespace

const char* segment_copy_cuda(const CopySegment* segs, int num_segs, void* stream) {
  for (int first = 0; first < num_segs; first += kMaxSegs) {
    const int n = std::min(kMaxSegs, num_segs - first);
    SegBatch batch{};
    uint64_t bits = 0;  // OR of everything that must be aligned to the word size
    int64_t max_bytes = 0, max_count = 0;
    for (int i = 0; i < n; ++i) {
      const CopySegment& s = segs[first + i];
      batch.seg[i] = s;
      bits |= reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) |
              static_cast<uint64_t>(s.block_bytes) | static_cast<uint64_t>(s.src_stride) |
              static_cast<uint64_t>(s.dst_stride);
      if (s.count > 0) max_bytes = std::max(max_bytes, s.block_bytes);
      max_count = std::max(max_count, s.count);
    }
    if (max_bytes == 0 || max_count == 0) continue;
    auto st = static_cast<cudaStream_t>(stream);
    if (bits % 16 == 0) {
      launch<uint4>(batch, n, max_bytes / 16, max_count, st);
    } else if (bits % 8 == 0) {
      launch<uint2>(batch, n, max_bytes / 8, max_count, st);
    } else if (bits % 4 == 0) {
      launch<uint32_t>(batch, n, max_bytes / 4, max_count, st);
    } else if (bits % 2 == 0) {
      launch<uint16_t>(batch, n, max_bytes / 2, max_count, st);
    } else {
      launch<uint8_t>(batch, n, max_bytes, max_count, st);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cudaGetErrorString(err);
  }
  return nullptr;
}

}  // namespace mv
