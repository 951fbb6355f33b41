// Mask predicates shared by the CPU and CUDA kernels (host and device), so both evaluate exactly
// the rules of megatron_video/ops/masks.py (DESIGN.md §2).
#pragma once
#include <cstdint>

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

// Exact verdict of a [q tile, k tile] from the tiles' bounds where they prove it: kEmptyTile,
// kFullTile, kPartialTile (an allowed and a masked pair are both proven to exist), else kUndecided
// and the caller scans the pairs. The bounds are attained by real tokens (the min / max of a row, of
// a side's blocks), so "some pair is masked / allowed" follows from the extremes: e.g. causal has a
// masked pair iff K.max(pos) > Q.min(pos) and an allowed pair iff K.min(pos) <= Q.max(pos). Rule R
// and same-doc flag D are compile-time; no branch depends on the data.
template <int R, bool D>
MV_HD int decide_tile_t(const TileSummary& Q, const TileSummary& K) {
  bool masked, allowed, empty;  // a masked pair exists / an allowed pair is proven / no pair allowed
  if constexpr (R == kCausal || R == kBlockCausal) {
    constexpr int r = R == kCausal ? 3 : 1;
    masked = K.hi[r] > Q.lo[r];
    allowed = K.lo[r] <= Q.hi[r];
    empty = !allowed;
  } else if constexpr (R == kTeacherForcing) {
    // clean->clean bk <= bq, noisy->clean bk < bq, noisy->noisy same block, clean->noisy never;
    // each (q side, k side) combination the tiles hold is judged on its own tokens' block range.
    const int64_t qlo0 = Q.side_block_lo[0], qhi0 = Q.side_block_hi[0];
    const int64_t qlo1 = Q.side_block_lo[1], qhi1 = Q.side_block_hi[1];
    const int64_t klo0 = K.side_block_lo[0], khi0 = K.side_block_hi[0];
    const int64_t klo1 = K.side_block_lo[1], khi1 = K.side_block_hi[1];
    const bool qc = qlo0 <= qhi0, qn = qlo1 <= qhi1, kc = klo0 <= khi0, kn = klo1 <= khi1;
    const bool cc = qc & kc, nc = qn & kc, nn = qn & kn, cn = qc & kn;
    const bool nn_all_same = (qlo1 == qhi1) & (klo1 == khi1) & (qlo1 == klo1);
    masked = (cc & (khi0 > qlo0)) | (nc & (khi0 >= qlo1)) | (nn & !nn_all_same) | cn;
    // noisy->noisy: an allowed pair is proven only by a shared extreme block
    allowed = (cc & (klo0 <= qhi0)) | (nc & (klo0 < qhi1)) |
              (nn & ((qlo1 == klo1) | (qlo1 == khi1) | (qhi1 == klo1) | (qhi1 == khi1)));
    empty = (!cc | (klo0 > qhi0)) & (!nc | (klo0 >= qhi1)) & (!nn | (khi1 < qlo1) | (klo1 > qhi1));
  } else {
    masked = false;
    allowed = true;
    empty = false;
  }
  if constexpr (D) {
    // Documents: disjoint ranges mask everything; one shared document leaves the rule as it is;
    // otherwise only an empty verdict stands and the rest is scanned.
    const bool one_doc = (Q.lo[2] == Q.hi[2]) & (K.lo[2] == K.hi[2]) & (Q.lo[2] == K.lo[2]);
    empty = empty | (K.hi[2] < Q.lo[2]) | (Q.hi[2] < K.lo[2]);
    if (!one_doc) return empty ? kEmptyTile : kUndecided;
  }
  return empty ? kEmptyTile : (!masked ? kFullTile : (allowed ? kPartialTile : kUndecided));
}

MV_HD int decide_tile(MaskSpec spec, const TileSummary& Q, const TileSummary& K) {
  switch (spec.rule) {
    case kCausal:
      return spec.same_doc ? decide_tile_t<kCausal, true>(Q, K) : decide_tile_t<kCausal, false>(Q, K);
    case kBlockCausal:
      return spec.same_doc ? decide_tile_t<kBlockCausal, true>(Q, K) : decide_tile_t<kBlockCausal, false>(Q, K);
    case kTeacherForcing:
      return spec.same_doc ? decide_tile_t<kTeacherForcing, true>(Q, K)
                           : decide_tile_t<kTeacherForcing, false>(Q, K);
    default:
      return spec.same_doc ? decide_tile_t<kFull, true>(Q, K) : decide_tile_t<kFull, false>(Q, K);
  }
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
  // Block range per side (0 clean, anything else noisy, as in rule_allows); none: lo > hi.
  int64_t slo[2] = {INT64_MAX, INT64_MAX}, shi[2] = {INT64_MIN, INT64_MIN};
  for (int64_t i = begin; i < end; ++i) {
    const int c = t.side[i] != 0;
    const int64_t b = t.block[i];
    slo[c] = b < slo[c] ? b : slo[c];
    shi[c] = b > shi[c] ? b : shi[c];
  }
  for (int c = 0; c < 2; ++c) {
    out->side_block_lo[c] = slo[c];
    out->side_block_hi[c] = shi[c];
  }
}

}  // namespace mv
