// CUDA mask construction: one thread per dense-mask element; one thread per tile summary; one
// 128-thread CTA per [q tile, k tile] status (bounds shortcut, else an exact scan that stops once
// both an allowed and a masked pair are seen). No host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "mask_rules.h"

namespace mv {
namespace {

__global__ void dense_mask_kernel(TokenIds q, TokenIds k, MaskSpec spec, bool* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= k.len) return;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; i < q.len;
       i += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    out[i * k.len + j] = allows(spec, q, i, k, j);
  }
}

__global__ void summarize_kernel(TokenIds t, int64_t tile, int64_t num_tiles, TileSummary* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_tiles) return;
  const int64_t end = (i + 1) * tile < t.len ? (i + 1) * tile : t.len;
  summarize(t, i * tile, end, out + i);
}

__global__ void block_status_kernel(TokenIds q, TokenIds k, MaskSpec spec, int64_t q_tile,
                                    int64_t k_tile, int64_t nk, const TileSummary* q_sum,
                                    const TileSummary* k_sum, uint8_t* status) {
  const int64_t tile = blockIdx.x;
  const int64_t qi = tile / nk, ki = tile % nk;
  int s = decide_tile(spec, q_sum[qi], k_sum[ki]);  // same value in every thread
  if (s == kUndecided) {
    const int64_t i0 = qi * q_tile, i1 = (qi + 1) * q_tile < q.len ? (qi + 1) * q_tile : q.len;
    const int64_t j0 = ki * k_tile, j1 = (ki + 1) * k_tile < k.len ? (ki + 1) * k_tile : k.len;
    const int64_t width = j1 - j0, pairs = (i1 - i0) * width;
    bool t = false, f = false;
    for (int64_t base = 0; base < pairs; base += blockDim.x) {
      const int64_t p = base + threadIdx.x;
      if (p < pairs) {
        const bool a = allows(spec, q, i0 + p / width, k, j0 + p % width);
        t |= a;
        f |= !a;
      }
      const int seen_t = __syncthreads_or(t);
      const int seen_f = __syncthreads_or(f);
      if (seen_t && seen_f) break;  // uniform: every thread got the same reductions
    }
    const bool any_t = __syncthreads_or(t), any_f = __syncthreads_or(f);
    s = any_t ? (any_f ? kPartialTile : kFullTile) : kEmptyTile;
  }
  if (threadIdx.x == 0) status[tile] = static_cast<uint8_t>(s);
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* dense_mask_cuda(TokenIds q, TokenIds k, MaskSpec spec, bool* out, void* stream) {
  if (q.len == 0 || k.len == 0) return nullptr;
  const dim3 threads(32, 8);
  const dim3 grid(static_cast<unsigned>((k.len + 31) / 32),
                  static_cast<unsigned>(std::min<int64_t>((q.len + 7) / 8, 65535)));
  dense_mask_kernel<<<grid, threads, 0, static_cast<cudaStream_t>(stream)>>>(q, k, spec, out);
  return last_error();
}

const char* block_status_cuda(TokenIds q, TokenIds k, MaskSpec spec, int64_t q_tile,
                              int64_t k_tile, TileSummary* q_sum, TileSummary* k_sum,
                              uint8_t* status, void* stream) {
  const int64_t nq = (q.len + q_tile - 1) / q_tile, nk = (k.len + k_tile - 1) / k_tile;
  if (nq == 0 || nk == 0) return nullptr;
  auto st = static_cast<cudaStream_t>(stream);
  summarize_kernel<<<static_cast<unsigned>((nq + 127) / 128), 128, 0, st>>>(q, q_tile, nq, q_sum);
  summarize_kernel<<<static_cast<unsigned>((nk + 127) / 128), 128, 0, st>>>(k, k_tile, nk, k_sum);
  if (const char* err = last_error()) return err;
  block_status_kernel<<<static_cast<unsigned>(nq * nk), 128, 0, st>>>(q, k, spec, q_tile, k_tile,
                                                                     nk, q_sum, k_sum, status);
  return last_error();
}

}  // namespace mv
