// Convolution, pooling and BatchNorm on Tensors: device and element-type checks, then
// the CPU op (backend/cpu/conv.cpp) or the CUDA op (backend/cuda/conv.cu).
#include "mpipe/backend/conv_ops.hpp"

#include <array>
#include <cstdint>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/backend/dispatch.hpp"
#include "mpipe/backend/op_profile.hpp"
#if MPIPE_HAVE_CUDA
#include "mpipe/backend/cuda/ops.hpp"
#endif

namespace mpipe::ops {

using namespace detail;

namespace {
#if MPIPE_HAVE_CUDA
// Device scratch for small per-call vectors (BatchNorm's deferred sums) and its host
// mirror: grown once to the largest call, so later steps allocate nothing.
struct SmallDeviceScratch {
  cuda::DeviceBuffer device;
  cuda::PinnedBuffer host;
  void* reserve(std::size_t bytes) {
    if (device.bytes() < bytes) {
      device = cuda::DeviceBuffer(bytes);
      host = cuda::PinnedBuffer(bytes);
    }
    return device.data();
  }
};
SmallDeviceScratch& small_scratch() {
  static SmallDeviceScratch scratch;  // ops are queued by the rank's one compute thread
  return scratch;
}
#endif
}  // namespace

int64_t conv2d_scratch(const Window2d& w, Device device) { return device == Device::cpu ? cpu::conv2d_cols(w) : 0; }

void conv2d_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias, const Tensor& cols,
                    const Window2d& w) {
  const OpTimer timer(OpKind::convolution, __func__);
  same_place("conv2d", out, inp);
  same_place("conv2d", inp, weight);
  same_place("conv2d", weight, bias);
  if (inp.device == Device::cpu) {
    MPIPE_CHECK(cols.numel() >= cpu::conv2d_cols(w), "conv2d: scratch of ", cols.numel(), " floats");
    cpu::conv2d_forward(out.f32(), inp.f32(), weight.f32(), ptr_or_null<float>(bias), cols.f32(), w);
  } else {
    MPIPE_ON_GPU(inp, cuda::conv2d_forward(ptr<E>(out), ptr<E>(inp), ptr<E>(weight), ptr_or_null<E>(bias), w));
  }
}

void conv2d_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight, const Tensor& cols, const Window2d& w, GradMode mode) {
  const OpTimer timer(OpKind::convolution, __func__);
  same_place("conv2d backward", dinp, dout);
  same_place("conv2d backward", dout, inp);
  same_place("conv2d backward", inp, weight);
  same_device("conv2d backward", dweight, dout);
  is_f32("conv2d backward", dweight);
  is_f32("conv2d backward", dbias);
  if (dout.device == Device::cpu)
    cpu::conv2d_backward(ptr_or_null<float>(dinp), ptr_or_null<float>(dweight), ptr_or_null<float>(dbias), dout.f32(),
                         inp.f32(), weight.f32(), cols.f32(), w, mode);
  else
    MPIPE_ON_GPU(dout, cuda::conv2d_backward(ptr_or_null<E>(dinp), ptr_or_null<float>(dweight), ptr_or_null<float>(dbias),
                                             ptr<E>(dout), ptr<E>(inp), ptr<E>(weight), w, mode));
}

void maxpool2d_forward(const Tensor& out, const Tensor& argmax, const Tensor& inp, const Window2d& w) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("maxpool2d", out, inp);
  same_device("maxpool2d", argmax, inp);
  MPIPE_CHECK(argmax.dtype == DType::i32, "maxpool2d: argmax of ", to_string(argmax.dtype));
  if (inp.device == Device::cpu) cpu::maxpool2d_forward(out.f32(), ptr<std::int32_t>(argmax), inp.f32(), w);
  else MPIPE_ON_GPU(inp, cuda::maxpool2d_forward(ptr<E>(out), ptr<std::int32_t>(argmax), ptr<E>(inp), w));
}

void maxpool2d_backward(const Tensor& dinp, const Tensor& dout, const Tensor& argmax, const Window2d& w, GradMode mode) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("maxpool2d backward", dinp, dout);
  if (dout.device == Device::cpu) cpu::maxpool2d_backward(dinp.f32(), dout.f32(), ptr<std::int32_t>(argmax), w, mode);
  else MPIPE_ON_GPU(dout, cuda::maxpool2d_backward(ptr<E>(dinp), ptr<E>(dout), ptr<std::int32_t>(argmax), w, mode));
}

void avgpool2d_forward(const Tensor& out, const Tensor& inp, const Window2d& w) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("avgpool2d", out, inp);
  if (inp.device == Device::cpu) cpu::avgpool2d_forward(out.f32(), inp.f32(), w);
  else MPIPE_ON_GPU(inp, cuda::avgpool2d_forward(ptr<E>(out), ptr<E>(inp), w));
}

void avgpool2d_backward(const Tensor& dinp, const Tensor& dout, const Window2d& w, GradMode mode) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("avgpool2d backward", dinp, dout);
  if (dout.device == Device::cpu) cpu::avgpool2d_backward(dinp.f32(), dout.f32(), w, mode);
  else MPIPE_ON_GPU(dout, cuda::avgpool2d_backward(ptr<E>(dinp), ptr<E>(dout), w, mode));
}

namespace {
// (N, C, plane) of a BatchNorm input.
std::array<int64_t, 3> channels_of(const Tensor& t) { return {t.shape[0], t.shape[1], t.numel() / (t.shape[0] * t.shape[1])}; }
}  // namespace

void batchnorm_forward_train(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& running_mean,
                             const Tensor& running_var, std::span<double> sums, const Tensor& inp, const Tensor& weight,
                             const Tensor& bias, float eps, float momentum, double* device_sums, bool relu) {
  const OpTimer timer(OpKind::normalization, __func__);
  same_place("batchnorm", out, inp);
  same_place("batchnorm", inp, weight);
  same_place("batchnorm", weight, bias);
  same_device("batchnorm", mean, inp);
  same_device("batchnorm", running_mean, inp);
  for (const Tensor* t : {&mean, &rstd, &running_mean, &running_var}) is_f32("batchnorm statistics", *t);
  const auto [N, C, plane] = channels_of(inp);
  MPIPE_CHECK(sums.empty() || sums.size() == static_cast<std::size_t>(1 + 2 * C), "batchnorm: ", sums.size(), " sums for ",
              C, " channels");
  MPIPE_CHECK(inp.device == Device::cuda ? sums.empty() : !device_sums,
              "batchnorm: a GPU gathers its sums in device memory, the CPU in host memory");
  if (inp.device == Device::cpu) {
    cpu::batchnorm_forward_train(out.f32(), mean.f32(), rstd.f32(), ptr_or_null<float>(running_mean),
                                 ptr_or_null<float>(running_var), sums.empty() ? nullptr : sums.data(), inp.f32(),
                                 weight.f32(), bias.f32(), N, C, plane, eps, momentum, relu);
    return;
  }
  MPIPE_ON_GPU(inp, cuda::batchnorm_forward_train(ptr<E>(out), mean.f32(), rstd.f32(), ptr_or_null<float>(running_mean),
                                                  ptr_or_null<float>(running_var), device_sums, ptr<E>(inp), ptr<E>(weight),
                                                  ptr<E>(bias), N, C, plane, eps, momentum, relu));
}

void batchnorm_apply_sums(const Tensor& running_mean, const Tensor& running_var, std::span<const double> sums,
                          float momentum) {
  const OpTimer timer(OpKind::normalization, __func__);
  is_f32("batchnorm running statistics", running_mean);
  is_f32("batchnorm running statistics", running_var);
  const int64_t C = running_mean.numel();
  MPIPE_CHECK(sums.size() == static_cast<std::size_t>(1 + 2 * C), "batchnorm: ", sums.size(), " sums for ", C, " channels");
  if (running_mean.device == Device::cpu) {
    cpu::batchnorm_apply_sums(running_mean.f32(), running_var.f32(), sums.data(), C, momentum);
    return;
  }
#if MPIPE_HAVE_CUDA
  auto* device_sums = static_cast<double*>(small_scratch().reserve(sums.size() * sizeof(double)));
  cuda::copy_to_device(device_sums, sums.data(), sums.size() * sizeof(double));
  cuda::batchnorm_apply_sums(running_mean.f32(), running_var.f32(), device_sums, C, momentum);
  cuda::synchronize(cuda::StreamKind::compute);  // the host's sums may change once this returns
#endif
}

void batchnorm_forward_eval(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                            const Tensor& running_mean, const Tensor& running_var, float eps) {
  const OpTimer timer(OpKind::normalization, __func__);
  same_place("batchnorm", out, inp);
  same_place("batchnorm", inp, weight);
  same_device("batchnorm", running_mean, inp);
  is_f32("batchnorm running statistics", running_mean);
  is_f32("batchnorm running statistics", running_var);
  const auto [N, C, plane] = channels_of(inp);
  if (inp.device == Device::cpu)
    cpu::batchnorm_forward_eval(out.f32(), inp.f32(), weight.f32(), bias.f32(), running_mean.f32(), running_var.f32(), N,
                                C, plane, eps);
  else
    MPIPE_ON_GPU(inp, cuda::batchnorm_forward_eval(ptr<E>(out), ptr<E>(inp), ptr<E>(weight), ptr<E>(bias),
                                                   running_mean.f32(), running_var.f32(), N, C, plane, eps));
}

void batchnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd, GradMode mode) {
  const OpTimer timer(OpKind::normalization, __func__);
  same_place("batchnorm backward", dinp, dout);
  same_place("batchnorm backward", dout, inp);
  same_place("batchnorm backward", inp, weight);
  same_device("batchnorm backward", dweight, inp);
  is_f32("batchnorm backward", dweight);
  is_f32("batchnorm backward", dbias);
  const auto [N, C, plane] = channels_of(inp);
  if (dout.device == Device::cpu)
    cpu::batchnorm_backward(ptr_or_null<float>(dinp), dweight.f32(), dbias.f32(), dout.f32(), inp.f32(), weight.f32(),
                            mean.f32(), rstd.f32(), N, C, plane, mode);
  else
    MPIPE_ON_GPU(dout, cuda::batchnorm_backward(ptr_or_null<E>(dinp), dweight.f32(), dbias.f32(), ptr<E>(dout), ptr<E>(inp),
                                                ptr<E>(weight), mean.f32(), rstd.f32(), N, C, plane, mode));
}

// ---- layout ----------------------------------------------------------------------------

void copy_runs(const Tensor& dst, const Tensor& src, const Runs& runs) {
  const OpTimer timer(OpKind::copy, __func__);
  same_place("copy_runs", dst, src);
  MPIPE_CHECK(runs.count == 0 || ((runs.count - 1) * runs.dst_stride + runs.dst_offset + runs.length <= dst.numel() &&
                                  (runs.count - 1) * runs.src_stride + runs.src_offset + runs.length <= src.numel()),
              "copy_runs: runs past ", dst.shape.str(), " or ", src.shape.str());
  if (src.device == Device::cpu) cpu::copy_runs(dst.f32(), src.f32(), runs);
  else MPIPE_ON_GPU(src, cuda::copy_runs(ptr<E>(dst), ptr<E>(src), runs));
}

void upsample_nearest_forward(const Tensor& out, const Tensor& inp, std::int64_t scale) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("upsample", out, inp);
  MPIPE_CHECK(inp.shape.rank == 4 && out.numel() == inp.numel() * scale * scale, "upsample: ", inp.shape.str(), " -> ",
              out.shape.str());
  const std::int64_t planes = inp.shape[0] * inp.shape[1], H = inp.shape[2], W = inp.shape[3];
  if (inp.device == Device::cpu) cpu::upsample_nearest_forward(out.f32(), inp.f32(), planes, H, W, scale);
  else MPIPE_ON_GPU(inp, cuda::upsample_nearest_forward(ptr<E>(out), ptr<E>(inp), planes, H, W, scale));
}

void upsample_nearest_backward(const Tensor& dinp, const Tensor& dout, std::int64_t scale) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("upsample backward", dinp, dout);
  MPIPE_CHECK(dinp.shape.rank == 4 && dout.numel() == dinp.numel() * scale * scale, "upsample backward: ",
              dinp.shape.str(), " <- ", dout.shape.str());
  const std::int64_t planes = dinp.shape[0] * dinp.shape[1], H = dinp.shape[2], W = dinp.shape[3];
  if (dout.device == Device::cpu) cpu::upsample_nearest_backward(dinp.f32(), dout.f32(), planes, H, W, scale);
  else MPIPE_ON_GPU(dout, cuda::upsample_nearest_backward(ptr<E>(dinp), ptr<E>(dout), planes, H, W, scale));
}

}  // namespace mpipe::ops
