// Mask predicates shared by the CPU and CUDA kernels (host and device), so both evaluate exactly
// the rules of megatron_video/ops/masks.py (DESIGN.md §2).
#pragma once
#include "kernels.h"

#if defined(__CUDACC__)
#define MV_HD __host__ __device__ __forceinline__
#else
#define MV_HD inline
#endif

namespace mv {

// Side: 0 clean, anything else noisy (the Python front admits 0 and 1 only).
template <int R>
MV_HD bool rule_allows(int64_t sq, int64_t bq, int64_t pq, int64_t sk, int64_t bk, int64_t pk) {
  if constexpr (R == kCausal) {
    return pk <= pq;
  } else if constexpr (R == kBlockCausal) {
    return bk <= bq;
  } else if constexpr (R == kTeacherForcing) {
    // clean->clean: bk <= bq; noisy->clean: bk < bq; noisy->noisy: same block; clean->noisy: never.
    return sk == 0 ? (sq == 0 ? bk <= bq : bk < bq) : (sq != 0 && bk == bq);
  } else {
    return true;
  }
}

MV_HD bool allows(MaskSpec spec, const TokenIds& q, int64_t i, const TokenIds& k, int64_t j) {
  if (spec.same_doc && q.doc[i] != k.doc[j]) return false;
  const int64_t sq = q.side[i], bq = q.block[i], pq = q.pos[i];
  const int64_t sk = k.side[j], bk = k.block[j], pk = k.pos[j];
  switch (spec.rule) {
    case kCausal: return rule_allows<kCausal>(sq, bq, pq, sk, bk, pk);
    case kBlockCausal: return rule_allows<kBlockCausal>(sq, bq, pq, sk, bk, pk);
    case kTeacherForcing: return rule_allows<kTeacherForcing>(sq, bq, pq, sk, bk, pk);
    default: return true;
  }
}

constexpr int kUndecided = -1;
constexpr int kEmptyTile = 0;
constexpr int kPartialTile = 1;
constexpr int kFullTile = 2;

// min/max bounds decide a rule for every pair of the tile: kFullTile, kEmptyTile or kUndecided.
MV_HD int range_rule(bool full_if, bool empty_if) {
  return full_if ? kFullTile : (empty_if ? kEmptyTile : kUndecided);
}

// Teacher forcing for one (q side, k side) combination, judged on the whole tiles' block ranges.
// Sub-populations (tokens of one side) have narrower ranges, so a full/empty verdict stays valid.
MV_HD int tf_combo(int64_t sq, int64_t sk, const TileSummary& Q, const TileSummary& K) {
  const int64_t qlo = Q.lo[1], qhi = Q.hi[1], klo = K.lo[1], khi = K.hi[1];
  if (sq == 0 && sk != 0) return kEmptyTile;
  if (sk == 0) {
    return sq == 0 ? range_rule(khi <= qlo, klo > qhi) : range_rule(khi < qlo, klo >= qhi);
  }
  return range_rule(qlo == qhi && klo == khi && qlo == klo, khi < qlo || klo > qhi);
}

MV_HD bool has_side(const TileSummary& t, int64_t noisy) {
  return noisy ? (t.lo[0] != 0 || t.hi[0] != 0) : (t.lo[0] <= 0 && 0 <= t.hi[0]);
}

// Cheap exact shortcut for a [q tile, k tile]: full / empty when the bounds prove it, otherwise
// kUndecided and the caller scans the pairs.
MV_HD int decide_tile(MaskSpec spec, const TileSummary& Q, const TileSummary& K) {
  bool doc_all = true;
  if (spec.same_doc) {
    if (K.hi[2] < Q.lo[2] || Q.hi[2] < K.lo[2]) return kEmptyTile;
    doc_all = Q.lo[2] == Q.hi[2] && K.lo[2] == K.hi[2] && Q.lo[2] == K.lo[2];
  }
  int r = kFullTile;
  if (spec.rule == kCausal) {
    r = range_rule(K.hi[3] <= Q.lo[3], K.lo[3] > Q.hi[3]);
  } else if (spec.rule == kBlockCausal) {
    r = range_rule(K.hi[1] <= Q.lo[1], K.lo[1] > Q.hi[1]);
  } else if (spec.rule == kTeacherForcing) {
    // Side classes that may occur (clean 0 / noisy non-zero); a class the range admits but the tile
    // lacks only makes the verdict more cautious.
    bool all_full = true, all_empty = true;
    for (int64_t sq = 0; sq < 2; ++sq) {
      if (!has_side(Q, sq)) continue;
      for (int64_t sk = 0; sk < 2; ++sk) {
        if (!has_side(K, sk)) continue;
        const int c = tf_combo(sq, sk, Q, K);
        all_full = all_full && c == kFullTile;
        all_empty = all_empty && c == kEmptyTile;
      }
    }
    r = all_empty ? kEmptyTile : (all_full ? kFullTile : kUndecided);
  }
  if (r == kEmptyTile) return kEmptyTile;
  if (r == kFullTile && doc_all) return kFullTile;
  return kUndecided;
}

MV_HD void summarize(const TokenIds& t, int64_t begin, int64_t end, TileSummary* out) {
  const int64_t* rows[4] = {t.side, t.block, t.doc, t.pos};
  for (int r = 0; r < 4; ++r) {
    int64_t lo = rows[r][begin], hi = lo;
    for (int64_t i = begin + 1; i < end; ++i) {
      const int64_t v = rows[r][i];
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    out->lo[r] = lo;
    out->hi[r] = hi;
  }
}

}  // namespace mv
