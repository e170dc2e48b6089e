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

// (N, C, plane) of an image tensor's logical shape.
std::array<int64_t, 3> channels_of(const Tensor& t) { return {t.shape[0], t.shape[1], t.numel() / (t.shape[0] * t.shape[1])}; }

// Channels last through channels first, where an op has no channels-last kernel (every
// image op on the CPU; a convolution direction cuDNN declines on a GPU): its operands
// swapped into channels-first buffers, the channels-first op run, its outputs swapped
// back. The swaps are copies, so that is the channels-first op's bits. Each buffer slot
// is grown once per device to the largest call and kept (later steps allocate nothing).
class Swapped {
 public:
  enum Slot { input, output_grad, output, input_grad, slots };
  // A channels-first copy of channels-last t (or an empty tensor for an empty one).
  static Tensor first(const Tensor& t, Slot slot) {
    if (t.empty()) return t;
    const Tensor f = like(t, slot);
    change_layout(f, t, false);
    return f;
  }
  // A channels-first buffer of t's shape and type, contents undefined (empty for empty).
  static Tensor like(const Tensor& t, Slot slot) {
    if (t.empty()) return t;
    return Tensor{reserve(t.device, slot, t.bytes()), t.shape, t.dtype, t.device};
  }
  // A channels-first input gradient for an op run per `mode`: dst's values swapped in
  // where the op adds to them, so it adds in its own order (the channels-first bits).
  static Tensor gradient(const Tensor& dst, GradMode mode) {
    return mode == GradMode::accumulate ? first(dst, input_grad) : like(dst, input_grad);
  }
  // dst (channels last) = f (channels first).
  static void back(const Tensor& dst, const Tensor& f) {
    if (!dst.empty()) change_layout(dst, f, true);
  }

 private:
  static void* reserve(Device device, Slot slot, std::size_t bytes) {
    if (device == Device::cpu) {
      static std::vector<float> host[slots];  // ops are queued by the rank's one compute thread
      std::vector<float>& b = host[slot];
      if (b.size() * sizeof(float) < bytes) b.resize((bytes + sizeof(float) - 1) / sizeof(float));
      return b.data();
    }
#if MPIPE_HAVE_CUDA
    static cuda::DeviceBuffer gpu[slots];
    cuda::DeviceBuffer& b = gpu[slot];
    if (b.bytes() < bytes) b = cuda::DeviceBuffer(bytes);
    return b.data();
#else
    throw Error("a tensor on the GPU in a build without CUDA");
#endif
  }
};
}  // namespace

void change_layout(const Tensor& dst, const Tensor& src, bool to_last, GradMode mode) {
  const OpTimer timer(OpKind::copy, __func__);
  same_place("change_layout", dst, src);
  MPIPE_CHECK(src.shape.rank >= 3 && dst.numel() == src.numel(), "change_layout: ", src.shape.str(), " -> ",
              dst.shape.str());
  const auto [N, C, plane] = channels_of(src);
  const int64_t A = to_last ? C : plane, B = to_last ? plane : C;
  const bool accumulate = mode == GradMode::accumulate;
  if (src.device == Device::cpu) cpu::swap_inner(dst.f32(), src.f32(), N, A, B, accumulate);
  else MPIPE_ON_GPU(src, cuda::swap_inner(ptr<E>(dst), ptr<E>(src), N, A, B, accumulate));
}

int64_t conv2d_scratch(const Window2d& w, Device device) { return device == Device::cpu ? cpu::conv2d_cols(w) : 0; }

namespace {
// The channels-first ops of convolution, pooling, BatchNorm and upsampling, on either device.
void conv2d_forward_first(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                          const Tensor& cols, const Window2d& w) {
  if (inp.device == Device::cpu) {
    MPIPE_CHECK(cols.numel() >= cpu::conv2d_cols(w), "conv2d: scratch of ", cols.numel(), " floats");
    cpu::conv2d_forward(out.f32(), inp.f32(), weight.f32(), ptr_or_null<float>(bias), cols.f32(), w);
  } else {
    MPIPE_ON_GPU(inp, cuda::conv2d_forward(ptr<E>(out), ptr<E>(inp), ptr<E>(weight), ptr_or_null<E>(bias), w));
  }
}

void conv2d_backward_first(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                           const Tensor& inp, const Tensor& weight, const Tensor& cols, const Window2d& w,
                           GradMode mode) {
  if (dout.device == Device::cpu)
    cpu::conv2d_backward(ptr_or_null<float>(dinp), ptr_or_null<float>(dweight), ptr_or_null<float>(dbias), dout.f32(),
                         inp.f32(), weight.f32(), cols.f32(), w, mode);
  else
    MPIPE_ON_GPU(dout, cuda::conv2d_backward(ptr_or_null<E>(dinp), ptr_or_null<float>(dweight), ptr_or_null<float>(dbias),
                                             ptr<E>(dout), ptr<E>(inp), ptr<E>(weight), w, mode));
}
}  // namespace

void conv2d_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias, const Tensor& cols,
                    const Window2d& w) {
  const OpTimer timer(OpKind::convolution, __func__);
  same_place("conv2d", out, inp);
  same_place("conv2d", inp, weight);
  same_place("conv2d", weight, bias);
  if (w.channels_last) {
    bool done = false;
    if (inp.device == Device::cuda)
      MPIPE_ON_GPU(inp, done = cuda::conv2d_forward_last(ptr<E>(out), ptr<E>(inp), ptr<E>(weight), ptr_or_null<E>(bias), w));
    if (done) return;
    Window2d first = w;
    first.channels_last = false;
    const Tensor y = Swapped::like(out, Swapped::output);
    conv2d_forward_first(y, Swapped::first(inp, Swapped::input), weight, bias, cols, first);
    Swapped::back(out, y);
    return;
  }
  conv2d_forward_first(out, inp, weight, bias, cols, w);
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
  if (!w.channels_last) {
    conv2d_backward_first(dinp, dweight, dbias, dout, inp, weight, cols, w, mode);
    return;
  }
  // Channels last: on a GPU each direction cuDNN takes (the bias gradient always), the
  // rest through channels first.
  Tensor input_grad = dinp, weight_grad = dweight, bias_grad = dbias;
  if (dout.device == Device::cuda)
    MPIPE_ON_GPU(dout, {
      if (!input_grad.empty() &&
          cuda::conv2d_input_gradient_last(ptr<E>(input_grad), ptr<E>(dout), ptr<E>(weight), w, mode))
        input_grad = Tensor{};
      if (!weight_grad.empty() && cuda::conv2d_weight_gradient_last(weight_grad.f32(), ptr<E>(dout), ptr<E>(inp), w))
        weight_grad = Tensor{};
      if (!bias_grad.empty()) cuda::conv2d_bias_gradient_last(bias_grad.f32(), ptr<E>(dout), w.N * w.OH * w.OW, w.OC);
      bias_grad = Tensor{};
    });
  if (input_grad.empty() && weight_grad.empty() && bias_grad.empty()) return;
  Window2d first = w;
  first.channels_last = false;
  const Tensor dx = Swapped::gradient(input_grad, mode);
  // The input is read for the weight gradient alone (on either device).
  conv2d_backward_first(dx, weight_grad, bias_grad, Swapped::first(dout, Swapped::output_grad),
                        weight_grad.empty() ? Tensor{} : Swapped::first(inp, Swapped::input), weight, cols, first, mode);
  Swapped::back(input_grad, dx);
}

void maxpool2d_forward(const Tensor& out, const Tensor& argmax, const Tensor& inp, const Window2d& w) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("maxpool2d", out, inp);
  same_device("maxpool2d", argmax, inp);
  MPIPE_CHECK(argmax.dtype == DType::i32, "maxpool2d: argmax of ", to_string(argmax.dtype));
  if (inp.device == Device::cpu && w.channels_last) {  // argmax then in channels-first order
    const Tensor y = Swapped::like(out, Swapped::output);
    cpu::maxpool2d_forward(y.f32(), ptr<std::int32_t>(argmax), Swapped::first(inp, Swapped::input).f32(), w);
    Swapped::back(out, y);
  } else if (inp.device == Device::cpu) {
    cpu::maxpool2d_forward(out.f32(), ptr<std::int32_t>(argmax), inp.f32(), w);
  } else MPIPE_ON_GPU(inp, cuda::maxpool2d_forward(ptr<E>(out), ptr<std::int32_t>(argmax), ptr<E>(inp), w));
}

void maxpool2d_backward(const Tensor& dinp, const Tensor& dout, const Tensor& argmax, const Window2d& w, GradMode mode) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("maxpool2d backward", dinp, dout);
  if (dout.device == Device::cpu && w.channels_last) {
    const Tensor dx = Swapped::gradient(dinp, mode);
    cpu::maxpool2d_backward(dx.f32(), Swapped::first(dout, Swapped::output_grad).f32(), ptr<std::int32_t>(argmax), w, mode);
    Swapped::back(dinp, dx);
  } else if (dout.device == Device::cpu) {
    cpu::maxpool2d_backward(dinp.f32(), dout.f32(), ptr<std::int32_t>(argmax), w, mode);
  } else MPIPE_ON_GPU(dout, cuda::maxpool2d_backward(ptr<E>(dinp), ptr<E>(dout), ptr<std::int32_t>(argmax), w, mode));
}

void avgpool2d_forward(const Tensor& out, const Tensor& inp, const Window2d& w) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("avgpool2d", out, inp);
  if (inp.device == Device::cpu && w.channels_last) {
    // A global pool's (N, C) output is the same in either layout: written in place.
    const bool image = out.shape.rank == 4;
    const Tensor y = image ? Swapped::like(out, Swapped::output) : out;
    cpu::avgpool2d_forward(y.f32(), Swapped::first(inp, Swapped::input).f32(), w);
    if (image) Swapped::back(out, y);
  } else if (inp.device == Device::cpu) {
    cpu::avgpool2d_forward(out.f32(), inp.f32(), w);
  } else MPIPE_ON_GPU(inp, cuda::avgpool2d_forward(ptr<E>(out), ptr<E>(inp), w));
}

void avgpool2d_backward(const Tensor& dinp, const Tensor& dout, const Window2d& w, GradMode mode) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("avgpool2d backward", dinp, dout);
  if (dout.device == Device::cpu && w.channels_last) {
    const Tensor dx = Swapped::gradient(dinp, mode);
    cpu::avgpool2d_backward(dx.f32(), dout.shape.rank == 4 ? Swapped::first(dout, Swapped::output_grad).f32() : dout.f32(),
                            w, mode);
    Swapped::back(dinp, dx);
  } else if (dout.device == Device::cpu) {
    cpu::avgpool2d_backward(dinp.f32(), dout.f32(), w, mode);
  } else MPIPE_ON_GPU(dout, cuda::avgpool2d_backward(ptr<E>(dinp), ptr<E>(dout), w, mode));
}

void batchnorm_forward_train(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& running_mean,
                             const Tensor& running_var, std::span<double> sums, const Tensor& inp, const Tensor& weight,
                             const Tensor& bias, float eps, float momentum, double* device_sums, bool relu,
                             bool channels_last) {
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
    const Tensor y = channels_last ? Swapped::like(out, Swapped::output) : out;
    cpu::batchnorm_forward_train(y.f32(), mean.f32(), rstd.f32(), ptr_or_null<float>(running_mean),
                                 ptr_or_null<float>(running_var), sums.empty() ? nullptr : sums.data(),
                                 (channels_last ? Swapped::first(inp, Swapped::input) : inp).f32(), weight.f32(),
                                 bias.f32(), N, C, plane, eps, momentum, relu);
    if (channels_last) Swapped::back(out, y);
    return;
  }
  if (channels_last)
    MPIPE_ON_GPU(inp, cuda::batchnorm_forward_train_last(ptr<E>(out), mean.f32(), rstd.f32(),
                                                         ptr_or_null<float>(running_mean), ptr_or_null<float>(running_var),
                                                         device_sums, ptr<E>(inp), ptr<E>(weight), ptr<E>(bias), N * plane,
                                                         C, eps, momentum, relu));
  else
    MPIPE_ON_GPU(inp, cuda::batchnorm_forward_train(ptr<E>(out), mean.f32(), rstd.f32(), ptr_or_null<float>(running_mean),
                                                    ptr_or_null<float>(running_var), device_sums, ptr<E>(inp),
                                                    ptr<E>(weight), ptr<E>(bias), N, C, plane, eps, momentum, relu));
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
                            const Tensor& running_mean, const Tensor& running_var, float eps, bool channels_last) {
  const OpTimer timer(OpKind::normalization, __func__);
  same_place("batchnorm", out, inp);
  same_place("batchnorm", inp, weight);
  same_device("batchnorm", running_mean, inp);
  is_f32("batchnorm running statistics", running_mean);
  is_f32("batchnorm running statistics", running_var);
  const auto [N, C, plane] = channels_of(inp);
  if (inp.device == Device::cpu) {
    const Tensor y = channels_last ? Swapped::like(out, Swapped::output) : out;
    cpu::batchnorm_forward_eval(y.f32(), (channels_last ? Swapped::first(inp, Swapped::input) : inp).f32(), weight.f32(),
                                bias.f32(), running_mean.f32(), running_var.f32(), N, C, plane, eps);
    if (channels_last) Swapped::back(out, y);
  } else {
    // Channels last: (N plane, C) rows, each element's channel its index mod C.
    MPIPE_ON_GPU(inp, cuda::batchnorm_forward_eval(ptr<E>(out), ptr<E>(inp), ptr<E>(weight), ptr<E>(bias),
                                                   running_mean.f32(), running_var.f32(), channels_last ? N * plane : N,
                                                   C, channels_last ? 1 : plane, eps));
  }
}

void batchnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd, GradMode mode,
                        bool channels_last) {
  const OpTimer timer(OpKind::normalization, __func__);
  same_place("batchnorm backward", dinp, dout);
  same_place("batchnorm backward", dout, inp);
  same_place("batchnorm backward", inp, weight);
  same_device("batchnorm backward", dweight, inp);
  is_f32("batchnorm backward", dweight);
  is_f32("batchnorm backward", dbias);
  const auto [N, C, plane] = channels_of(inp);
  if (dout.device == Device::cpu && channels_last) {
    const Tensor dx = Swapped::gradient(dinp, mode);
    cpu::batchnorm_backward(ptr_or_null<float>(dx), dweight.f32(), dbias.f32(), Swapped::first(dout, Swapped::output_grad).f32(),
                            Swapped::first(inp, Swapped::input).f32(), weight.f32(), mean.f32(), rstd.f32(), N, C, plane,
                            mode);
    Swapped::back(dinp, dx);
  } else if (dout.device == Device::cpu) {
    cpu::batchnorm_backward(ptr_or_null<float>(dinp), dweight.f32(), dbias.f32(), dout.f32(), inp.f32(), weight.f32(),
                            mean.f32(), rstd.f32(), N, C, plane, mode);
  } else if (channels_last) {
    MPIPE_ON_GPU(dout, cuda::batchnorm_backward_last(ptr_or_null<E>(dinp), dweight.f32(), dbias.f32(), ptr<E>(dout),
                                                     ptr<E>(inp), ptr<E>(weight), mean.f32(), rstd.f32(), N * plane, C,
                                                     mode));
  } else {
    MPIPE_ON_GPU(dout, cuda::batchnorm_backward(ptr_or_null<E>(dinp), dweight.f32(), dbias.f32(), ptr<E>(dout), ptr<E>(inp),
                                                ptr<E>(weight), mean.f32(), rstd.f32(), N, C, plane, mode));
  }
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

void upsample_nearest_forward(const Tensor& out, const Tensor& inp, std::int64_t scale, bool channels_last) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("upsample", out, inp);
  MPIPE_CHECK(inp.shape.rank == 4 && out.numel() == inp.numel() * scale * scale, "upsample: ", inp.shape.str(), " -> ",
              out.shape.str());
  const std::int64_t planes = inp.shape[0] * inp.shape[1], H = inp.shape[2], W = inp.shape[3];
  if (inp.device == Device::cpu && channels_last) {
    const Tensor y = Swapped::like(out, Swapped::output);
    cpu::upsample_nearest_forward(y.f32(), Swapped::first(inp, Swapped::input).f32(), planes, H, W, scale);
    Swapped::back(out, y);
  } else if (inp.device == Device::cpu) {
    cpu::upsample_nearest_forward(out.f32(), inp.f32(), planes, H, W, scale);
  } else {
    const std::int64_t C = inp.shape[1];
    MPIPE_ON_GPU(inp, cuda::upsample_nearest_forward(ptr<E>(out), ptr<E>(inp), channels_last ? planes / C : planes, H, W,
                                                     scale, channels_last ? C : 1));
  }
}

void upsample_nearest_backward(const Tensor& dinp, const Tensor& dout, std::int64_t scale, bool channels_last) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("upsample backward", dinp, dout);
  MPIPE_CHECK(dinp.shape.rank == 4 && dout.numel() == dinp.numel() * scale * scale, "upsample backward: ",
              dinp.shape.str(), " <- ", dout.shape.str());
  const std::int64_t planes = dinp.shape[0] * dinp.shape[1], H = dinp.shape[2], W = dinp.shape[3];
  if (dout.device == Device::cpu && channels_last) {
    const Tensor dx = Swapped::like(dinp, Swapped::input_grad);  // overwritten
    cpu::upsample_nearest_backward(dx.f32(), Swapped::first(dout, Swapped::output_grad).f32(), planes, H, W, scale);
    Swapped::back(dinp, dx);
  } else if (dout.device == Device::cpu) {
    cpu::upsample_nearest_backward(dinp.f32(), dout.f32(), planes, H, W, scale);
  } else {
    const std::int64_t C = dinp.shape[1];
    MPIPE_ON_GPU(dout, cuda::upsample_nearest_backward(ptr<E>(dinp), ptr<E>(dout), channels_last ? planes / C : planes, H,
                                                       W, scale, channels_last ? C : 1));
  }
}

}  // namespace mpipe::ops
