// CPU segment copy: every rank's strided blocks, cut into ~1 MiB pieces, copied in one
// at::parallel_for (halo scatter and halo gather both reduce to this).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace mv {

void segment_copy_cpu(const CopySegment* segs, int num_segs) {
  constexpr int64_t kPiece = int64_t(1) << 20;
  struct Piece {
    const char* src;
    char* dst;
    int64_t bytes;
  };
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (int s = 0; s < num_segs; ++s) {
    const CopySegment& g = segs[s];
    for (int64_t b = 0; b < g.count; ++b) {
      for (int64_t off = 0; off < g.block_bytes; off += kPiece) {
        pieces.push_back({g.src + b * g.src_stride + off, g.dst + b * g.dst_stride + off,
                          std::min(kPiece, g.block_bytes - off)});
      }
    }
    total += g.count * g.block_bytes;
  }
  if (pieces.empty()) return;
  // Small pieces (narrow latents) are grouped so each task moves at least ~256 KiB.
  const int64_t avg = std::max<int64_t>(1, total / static_cast<int64_t>(pieces.size()));
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / avg);
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
  });
}

}  // namespace mv
