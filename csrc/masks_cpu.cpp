// CPU mask construction: dense bool masks and [q tile, k tile] status (empty / partial / full).
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "mask_rules.h"

namespace mv {
namespace {

// Calls f with the rule and the same-doc flag as compile-time constants, so the inner loops have
// no per-pair switch and vectorise.
template <typename F>
void with_spec(MaskSpec spec, F&& f) {
  auto with_rule = [&](auto doc) {
    switch (spec.rule) {
      case kCausal: f(std::integral_constant<int, kCausal>{}, doc); break;
      case kBlockCausal: f(std::integral_constant<int, kBlockCausal>{}, doc); break;
      case kTeacherForcing: f(std::integral_constant<int, kTeacherForcing>{}, doc); break;
      default: f(std::integral_constant<int, kFull>{}, doc); break;
    }
  };
  if (spec.same_doc) {
    with_rule(std::true_type{});
  } else {
    with_rule(std::false_type{});
  }
}

// One q row against keys [j0, j1): writes the row when W, and returns the OR / AND-NOT
// of the allowed bits through `any_true` / `any_false`.
template <int R, bool D, bool W>
inline void row_pass(const TokenIds& q, int64_t i, const TokenIds& k, int64_t j0, int64_t j1,
                     bool* row, bool& any_true, bool& any_false) {
  const int64_t sq = q.side[i], bq = q.block[i], pq = q.pos[i], dq = q.doc[i];
  bool t = false, f = false;
  for (int64_t j = j0; j < j1; ++j) {
    bool a = rule_allows<R>(sq, bq, pq, k.side[j], k.block[j], k.pos[j]);
    if constexpr (D) a = a && k.doc[j] == dq;
    if constexpr (W) row[j] = a;
    t |= a;
    f |= !a;
  }
  any_true |= t;
  any_false |= f;
}

}  // namespace

void dense_mask_cpu(TokenIds q, TokenIds k, MaskSpec spec, bool* out) {
  if (q.len == 0 || k.len == 0) return;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / k.len);
  with_spec(spec, [&](auto rule, auto doc) {
    at::parallel_for(0, q.len, grain, [&](int64_t b, int64_t e) {
      bool t = false, f = false;
      for (int64_t i = b; i < e; ++i) {
        row_pass<decltype(rule)::value, decltype(doc)::value, true>(q, i, k, 0, k.len, out + i * k.len, t, f);
      }
    });
  });
}

void block_status_cpu(TokenIds q, TokenIds k, MaskSpec spec, int64_t q_tile, int64_t k_tile,
                      uint8_t* status) {
  const int64_t nq = (q.len + q_tile - 1) / q_tile;
  const int64_t nk = (k.len + k_tile - 1) / k_tile;
  if (nq == 0 || nk == 0) return;
  std::vector<TileSummary> qs(nq), ks(nk);
  at::parallel_for(0, nq, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) summarize(q, t * q_tile, std::min(q.len, (t + 1) * q_tile), &qs[t]);
  });
  at::parallel_for(0, nk, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) summarize(k, t * k_tile, std::min(k.len, (t + 1) * k_tile), &ks[t]);
  });
  with_spec(spec, [&](auto rule, auto doc) {
    constexpr int R = decltype(rule)::value;
    constexpr bool D = decltype(doc)::value;
    // One q-tile row at a time: the bounds verdict along the row (branch-free), then an exact scan
    // of the row's undecided tiles, stopped as soon as both an allowed and a masked pair are seen.
    at::parallel_for(0, nq, std::max<int64_t>(1, 4096 / nk), [&](int64_t b, int64_t e) {
      for (int64_t qi = b; qi < e; ++qi) {
        uint8_t* row = status + qi * nk;
        const TileSummary& Q = qs[qi];
        bool undecided = false;
        for (int64_t ki = 0; ki < nk; ++ki) {
          const int s = decide_tile_t<R, D>(Q, ks[ki]);
          row[ki] = static_cast<uint8_t>(s);  // kUndecided is written as 255
          undecided |= s == kUndecided;
        }
        if (!undecided) continue;
        const int64_t i0 = qi * q_tile, i1 = std::min(q.len, (qi + 1) * q_tile);
        for (int64_t ki = 0; ki < nk; ++ki) {
          if (row[ki] != static_cast<uint8_t>(kUndecided)) continue;
          const int64_t j0 = ki * k_tile, j1 = std::min(k.len, (ki + 1) * k_tile);
          bool t = false, f = false;
          for (int64_t i = i0; i < i1 && !(t && f); ++i) {
            row_pass<R, D, false>(q, i, k, j0, j1, nullptr, t, f);
          }
          row[ki] = static_cast<uint8_t>(t ? (f ? kPartialTile : kFullTile) : kEmptyTile);
        }
      }
    });
  });
}

}  // namespace mv
