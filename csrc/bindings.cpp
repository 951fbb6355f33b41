// megatron_video._C: tensors -> raw pointers for the kernels of kernels.h, device dispatch and
// pybind11 bindings. The Python front (megatron_video/ops) validates arguments with ValueError;
// the TORCH_CHECKs here guard direct callers.
#include <torch/extension.h>

#include <vector>

#include "kernels.h"

#ifdef MEGATRON_VIDEO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

#ifdef MEGATRON_VIDEO_WITH_CUDA
void* stream_of(const at::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

void check_launch(const char* err, const char* op) {
  TORCH_CHECK(err == nullptr, "megatron_video._C.", op, ": CUDA launch failed: ", err);
}
#endif

void check_device(const at::Device& device, const char* op) {
#ifdef MEGATRON_VIDEO_WITH_CUDA
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "megatron_video._C.", op,
              ": tensors must be on CPU or CUDA, got ", device);
#else
  TORCH_CHECK(device.is_cpu(), "megatron_video._C.", op,
              ": this build has CPU kernels only, got a tensor on ", device);
#endif
}

void run_copy(const std::vector<mv::CopySegment>& segs, const at::Device& device) {
  check_device(device, "segment_copy");
  if (device.is_cpu()) {
    mv::segment_copy_cpu(segs.data(), static_cast<int>(segs.size()));
    return;
  }
#ifdef MEGATRON_VIDEO_WITH_CUDA
  const c10::cuda::CUDAGuard guard(device);
  check_launch(mv::segment_copy_cuda(segs.data(), static_cast<int>(segs.size()), stream_of(device)),
               "segment_copy");
#endif
}

// x: [outer, T, inner] contiguous; windows: [P, 2] int64 on CPU, 0 <= start < end <= T.
// Returns (flat buffer with rank p's [outer, end-start, inner] at offsets[p], offsets, sizes).
std::vector<at::Tensor> halo_scatter(const at::Tensor& x, const at::Tensor& windows) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "halo_scatter: x must be a contiguous [outer, T, inner] tensor");
  TORCH_CHECK(windows.device().is_cpu() && windows.scalar_type() == at::kLong && windows.dim() == 2 &&
                  windows.size(1) == 2,
              "halo_scatter: windows must be a [P, 2] int64 CPU tensor");
  const auto w = windows.contiguous();
  const int64_t P = w.size(0), outer = x.size(0), T = x.size(1), inner = x.size(2);
  const int64_t* win = w.data_ptr<int64_t>();
  auto offsets = at::empty({P}, w.options());
  auto sizes = at::empty({P}, w.options());
  int64_t total = 0;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t s = win[2 * p], e = win[2 * p + 1];
    TORCH_CHECK(0 <= s && s < e && e <= T, "halo_scatter: window ", p, " = [", s, ", ", e,
                ") must satisfy 0 <= start < end <= T = ", T);
    offsets.data_ptr<int64_t>()[p] = total;
    sizes.data_ptr<int64_t>()[p] = outer * (e - s) * inner;
    total += outer * (e - s) * inner;
  }
  auto buffer = at::empty({total}, x.options());
  const int64_t es = x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(buffer.data_ptr());
  std::vector<mv::CopySegment> segs;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t s = win[2 * p], tp = win[2 * p + 1] - s;
    segs.push_back({src + s * inner * es, dst + offsets.data_ptr<int64_t>()[p] * es, outer,
                    tp * inner * es, T * inner * es, tp * inner * es});
  }
  run_copy(segs, x.device());
  return {buffer, offsets, sizes};
}

// parts[p]: [outer, T_p, inner] contiguous, same dtype/device/outer/inner; drop: [P] int64 CPU.
// Returns [outer, sum(T_p - drop_p), inner] with rank p's frames [drop_p, T_p) in rank order.
at::Tensor halo_gather(const std::vector<at::Tensor>& parts, const at::Tensor& drop) {
  TORCH_CHECK(!parts.empty(), "halo_gather: needs at least one rank");
  TORCH_CHECK(drop.device().is_cpu() && drop.scalar_type() == at::kLong && drop.dim() == 1 &&
                  drop.size(0) == static_cast<int64_t>(parts.size()),
              "halo_gather: drop must be a [P] int64 CPU tensor");
  const auto d = drop.contiguous();
  const at::Tensor& first = parts[0];
  const int64_t outer = first.size(0), inner = first.size(2);
  int64_t kept_total = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const at::Tensor& t = parts[p];
    TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.size(0) == outer && t.size(2) == inner &&
                    t.scalar_type() == first.scalar_type() && t.device() == first.device(),
                "halo_gather: part ", p, " must be a contiguous [outer, T_p, inner] tensor like part 0");
    const int64_t dp = d.data_ptr<int64_t>()[p];
    TORCH_CHECK(0 <= dp && dp <= t.size(1), "halo_gather: drop[", p, "] = ", dp,
                " must be in [0, T_p = ", t.size(1), "]");
    kept_total += t.size(1) - dp;
  }
  auto out = at::empty({outer, kept_total, inner}, first.options());
  const int64_t es = first.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  std::vector<mv::CopySegment> segs;
  int64_t frame = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t tp = parts[p].size(1), dp = d.data_ptr<int64_t>()[p], kept = tp - dp;
    segs.push_back({static_cast<const char*>(parts[p].data_ptr()) + dp * inner * es,
                    dst + frame * inner * es, outer, kept * inner * es, tp * inner * es,
                    kept_total * inner * es});
    frame += kept;
  }
  run_copy(segs, first.device());
  return out;
}

// ids: [4, L] int64 contiguous rows (side, block, doc, pos).
mv::TokenIds token_ids(const at::Tensor& ids, const char* name) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == 4 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "megatron_video._C: ", name, " must be a contiguous [4, L] int64 tensor");
  const int64_t* base = ids.data_ptr<int64_t>();
  const int64_t L = ids.size(1);
  return {base, base + L, base + 2 * L, base + 3 * L, L};
}

at::Tensor dense_mask(const at::Tensor& q_ids, const at::Tensor& k_ids, int64_t rule, bool same_doc) {
  TORCH_CHECK(q_ids.device() == k_ids.device(), "dense_mask: q_ids and k_ids must share a device");
  check_device(q_ids.device(), "dense_mask");
  const mv::TokenIds q = token_ids(q_ids, "q_ids"), k = token_ids(k_ids, "k_ids");
  const mv::MaskSpec spec{static_cast<int>(rule), same_doc};
  auto out = at::empty({q.len, k.len}, q_ids.options().dtype(at::kBool));
  if (q_ids.device().is_cpu()) {
    mv::dense_mask_cpu(q, k, spec, out.data_ptr<bool>());
    return out;
  }
#ifdef MEGATRON_VIDEO_WITH_CUDA
  const c10::cuda::CUDAGuard guard(q_ids.device());
  check_launch(mv::dense_mask_cuda(q, k, spec, out.data_ptr<bool>(), stream_of(q_ids.device())), "dense_mask");
#endif
  return out;
}

at::Tensor block_status(const at::Tensor& q_ids, const at::Tensor& k_ids, int64_t rule, bool same_doc,
                        int64_t q_tile, int64_t k_tile) {
  TORCH_CHECK(q_ids.device() == k_ids.device(), "block_status: q_ids and k_ids must share a device");
  TORCH_CHECK(q_tile > 0 && k_tile > 0, "block_status: tile sizes must be positive");
  check_device(q_ids.device(), "block_status");
  const mv::TokenIds q = token_ids(q_ids, "q_ids"), k = token_ids(k_ids, "k_ids");
  const mv::MaskSpec spec{static_cast<int>(rule), same_doc};
  const int64_t nq = (q.len + q_tile - 1) / q_tile, nk = (k.len + k_tile - 1) / k_tile;
  auto status = at::empty({nq, nk}, q_ids.options().dtype(at::kByte));
  if (q_ids.device().is_cpu()) {
    mv::block_status_cpu(q, k, spec, q_tile, k_tile, status.data_ptr<uint8_t>());
    return status;
  }
#ifdef MEGATRON_VIDEO_WITH_CUDA
  TORCH_CHECK(nq * nk < (int64_t(1) << 31), "block_status: ", nq, " x ", nk, " tiles exceed one CUDA grid");
  const c10::cuda::CUDAGuard guard(q_ids.device());
  constexpr int64_t kWords = sizeof(mv::TileSummary) / sizeof(int64_t);
  auto q_sum = at::empty({nq, kWords}, q_ids.options());
  auto k_sum = at::empty({nk, kWords}, q_ids.options());
  check_launch(mv::block_status_cuda(q, k, spec, q_tile, k_tile,
                                     reinterpret_cast<mv::TileSummary*>(q_sum.data_ptr<int64_t>()),
                                     reinterpret_cast<mv::TileSummary*>(k_sum.data_ptr<int64_t>()),
                                     status.data_ptr<uint8_t>(), stream_of(q_ids.device())),
               "block_status");
#endif
  return status;
}

bool has_cuda() {
#ifdef MEGATRON_VIDEO_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_video C++/CUDA kernels: fused halo scatter/gather and mask construction";
  m.def("halo_scatter", &halo_scatter, "Pack every rank's raw-frame window into one buffer",
        py::arg("x"), py::arg("windows"));
  m.def("halo_gather", &halo_gather, "Concatenate the kept latents of all ranks", py::arg("parts"),
        py::arg("drop"));
  m.def("dense_mask", &dense_mask, "Dense bool mask from token identities", py::arg("q_ids"),
        py::arg("k_ids"), py::arg("rule"), py::arg("same_doc"));
  m.def("block_status", &block_status, "Per-tile status: 0 empty, 1 partial, 2 full",
        py::arg("q_ids"), py::arg("k_ids"), py::arg("rule"), py::arg("same_doc"), py::arg("q_tile"),
        py::arg("k_tile"));
  m.def("has_cuda", &has_cuda, "Whether the CUDA kernels were compiled in");
}
