// The convolutional CUDA ops against their CPU twins (backend/cpu/conv.cpp), in fp32 and
// bf16: convolution (stride, padding, groups, 1x1, bias or none; forward, the input
// gradient and the weight and bias gradients, alone as a split backward does and together,
// per GradMode; the fp32 weight and bias gradients added to nonzero ones, the weight's
// twice), max and average pooling (padded, overlapping windows, global), BatchNorm
// (training with running statistics, the deferred rule's sums, evaluation, backward), and
// the per-pixel cross-entropy over (N, C, H, W) as it lies; and every image op on
// channels-last (NHWC) tensors against the CPU's channels-first ops (tests/image_ops.hpp).
// Compared by normalized error as in test_cuda_ops.cpp; the gathers that add in the CPU's
// order (pooling backward) bit for bit in fp32; every reducing op rerun for the same bits.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "compare.hpp"
#include "device_data.hpp"
#include "image_ops.hpp"
#include "mpipe/backend/conv_ops.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/rng.hpp"

using namespace mpipe;

using namespace mpipe::test;

namespace {

int64_t swept(int64_t size, int64_t kernel, int64_t stride, int64_t padding) {
  return (size + 2 * padding - kernel) / stride + 1;
}

Window2d window(int64_t N, int64_t C, int64_t H, int64_t W, int64_t OC, int64_t kernel, int64_t stride, int64_t padding,
                int64_t groups) {
  Window2d w;
  w.N = N, w.C = C, w.H = H, w.W = W, w.OC = OC;
  w.KH = w.KW = kernel;
  w.stride = stride, w.padding = padding, w.groups = groups;
  w.OH = swept(H, kernel, stride, padding);
  w.OW = swept(W, kernel, stride, padding);
  return w;
}

std::size_t input_size(const Window2d& w) { return static_cast<std::size_t>(w.N * w.C * w.H * w.W); }
std::size_t output_size(const Window2d& w) { return static_cast<std::size_t>(w.N * w.OC * w.OH * w.OW); }

// The fp32 weight gradient's tolerance. The GEMM path sums into it in fp32; cuDNN's bf16
// path writes the gradient in bf16 before adding it (conv_dnn.cu), a result stored as E.
// Under MPIPE_CONV=gemm (ctest cuda.conv_gemm) the GEMM path is held to its own.
template <class E>
double weight_grad_tolerance() {
  const char* mode = std::getenv("MPIPE_CONV");
  const bool gemm_only = mode && std::strcmp(mode, "gemm") == 0;
  return gemm_only ? gemm_grad_tolerance<E> : tolerance<E>;
}

}  // namespace

// ---- convolution -------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: conv2d forward and backward match the CPU (stride, padding, groups, 1x1)", E, float, bf16) {
  struct Case {
    int64_t N, C, H, W, OC, kernel, stride, padding, groups;
    bool bias;
  };
  // 3x3 padded; strided 7x7 stem on an odd plane; grouped; depthwise; 1x1; strided 1x1
  // without bias (a projection); a non-square plane with a kernel as large as it.
  for (const Case& k : {Case{2, 3, 9, 9, 8, 3, 1, 1, 1, true}, Case{3, 3, 17, 17, 16, 7, 2, 3, 1, false},
                       Case{2, 8, 10, 10, 12, 3, 1, 1, 4, true}, Case{2, 6, 7, 7, 6, 3, 2, 1, 6, false},
                       Case{4, 16, 5, 5, 24, 1, 1, 0, 1, true}, Case{2, 16, 9, 9, 32, 1, 2, 0, 1, false},
                       Case{1, 2, 4, 6, 3, 4, 1, 0, 1, true}}) {
    CAPTURE(k.C);
    CAPTURE(k.kernel);
    CAPTURE(k.stride);
    CAPTURE(k.groups);
    const Window2d w = window(k.N, k.C, k.H, k.W, k.OC, k.kernel, k.stride, k.padding, k.groups);
    const std::size_t wsize = static_cast<std::size_t>(w.OC * (w.C / w.groups) * w.KH * w.KW);
    const auto inp = rounded<E>(normals(input_size(w), 1));
    const auto weight = rounded<E>(normals(wsize, 2, 0.3f));
    const auto bias = rounded<E>(normals(static_cast<std::size_t>(w.OC), 3));
    const auto dout = rounded<E>(normals(output_size(w), 4));
    const auto dinp_before = rounded<E>(normals(input_size(w), 5));
    const auto dweight_before = normals(wsize, 6);
    const auto dbias_before = normals(static_cast<std::size_t>(w.OC), 7);

    std::vector<float> cols(static_cast<std::size_t>(cpu::conv2d_cols(w)));
    std::vector<float> out(output_size(w));
    cpu::conv2d_forward(out.data(), inp.data(), weight.data(), k.bias ? bias.data() : nullptr, cols.data(), w);
    std::vector<float> dinp = dinp_before, dweight = dweight_before, dbias = dbias_before;
    cpu::conv2d_backward(dinp.data(), dweight.data(), k.bias ? dbias.data() : nullptr, dout.data(), inp.data(),
                         weight.data(), cols.data(), w, GradMode::accumulate);
    std::vector<float> dinp_overwritten(input_size(w));
    cpu::conv2d_backward(dinp_overwritten.data(), nullptr, nullptr, dout.data(), inp.data(), weight.data(), cols.data(),
                         w, GradMode::overwrite);

    const DeviceArray<E> d_inp = upload<E>(inp), d_weight = upload<E>(weight), d_bias = upload<E>(bias),
                         d_dout = upload<E>(dout);
    DeviceArray<E> d_out(output_size(w)), d_dinp = upload<E>(dinp_before), d_dinp2(input_size(w));
    DeviceArray<float> d_dweight(dweight_before), d_dbias(dbias_before);
    cuda::conv2d_forward(d_out.get(), d_inp.get(), d_weight.get(), k.bias ? d_bias.get() : nullptr, w);
    CHECK(error(download(d_out), out) < tolerance<E>);
    // The full backward in one call, accumulating everything.
    cuda::conv2d_backward(d_dinp.get(), d_dweight.get(), k.bias ? d_dbias.get() : nullptr, d_dout.get(), d_inp.get(),
                          d_weight.get(), w, GradMode::accumulate);
    CHECK(error(download(d_dinp), dinp) < tolerance<E>);
    CHECK(error(d_dweight.read(), dweight) < weight_grad_tolerance<E>());
    if (k.bias) CHECK(error(d_dbias.read(), dbias) < gemm_grad_tolerance<E>);
    else CHECK(same_bits(d_dbias.read(), dbias_before));  // no bias: untouched
    // A split backward: the input gradient alone (overwritten), then the weight's.
    cuda::conv2d_backward(d_dinp2.get(), nullptr, nullptr, d_dout.get(), d_inp.get(), d_weight.get(), w,
                          GradMode::overwrite);
    CHECK(error(download(d_dinp2), dinp_overwritten) < tolerance<E>);
    DeviceArray<float> d_dweight_split(dweight_before), d_dbias_split(dbias_before);
    cuda::conv2d_backward<E>(nullptr, d_dweight_split.get(), k.bias ? d_dbias_split.get() : nullptr, d_dout.get(),
                             d_inp.get(), d_weight.get(), w, GradMode::accumulate);
    // The same algorithms (cuDNN's or the GEMMs) and sums as the full backward's: the same
    // bits.
    CHECK(same_bits(d_dweight_split.read(), d_dweight.read()));
    CHECK(same_bits(d_dbias_split.read(), d_dbias.read()));
    // The bias gradient alone sums dout without the GEMMs' permuted copy, which the full
    // backward summed wherever a GEMM ran (all of it under MPIPE_CONV=gemm): the same
    // order, so the same bits.
    if (k.bias) {
      DeviceArray<float> d_dbias_alone(dbias_before);
      cuda::conv2d_backward<E>(nullptr, nullptr, d_dbias_alone.get(), d_dout.get(), d_inp.get(), d_weight.get(), w,
                               GradMode::accumulate);
      CHECK(same_bits(d_dbias_alone.read(), d_dbias.read()));
    }
    // The weight gradient added once more: before + 2 gradients.
    std::vector<float> dweight_twice = dweight;
    cpu::conv2d_backward(nullptr, dweight_twice.data(), nullptr, dout.data(), inp.data(), weight.data(), cols.data(), w,
                         GradMode::accumulate);
    cuda::conv2d_backward<E>(nullptr, d_dweight_split.get(), nullptr, d_dout.get(), d_inp.get(), d_weight.get(), w,
                             GradMode::accumulate);
    CHECK(error(d_dweight_split.read(), dweight_twice) < weight_grad_tolerance<E>());
    // Rerun: the same bits.
    DeviceArray<E> d_out2(output_size(w));
    cuda::conv2d_forward(d_out2.get(), d_inp.get(), d_weight.get(), k.bias ? d_bias.get() : nullptr, w);
    CHECK(same_bits(d_out2.read(), d_out.read()));
    DeviceArray<E> d_dinp3(input_size(w));
    cuda::conv2d_backward(d_dinp3.get(), nullptr, nullptr, d_dout.get(), d_inp.get(), d_weight.get(), w,
                          GradMode::overwrite);
    CHECK(same_bits(d_dinp3.read(), d_dinp2.read()));
  }
}

TEST_CASE("cuda op: conv2d at a ResNet-50 stage shape in bf16 (N 8, 64 -> 64, 56 x 56, 3 x 3)") {
  const Window2d w = window(8, 64, 56, 56, 64, 3, 1, 1, 1);
  const std::size_t wsize = static_cast<std::size_t>(64 * 64 * 9);
  const auto inp = rounded<bf16>(normals(input_size(w), 11));
  const auto weight = rounded<bf16>(normals(wsize, 12, 0.05f));
  const auto dout = rounded<bf16>(normals(output_size(w), 13));
  std::vector<float> cols(static_cast<std::size_t>(cpu::conv2d_cols(w))), out(output_size(w)), dinp(input_size(w)),
      dweight(wsize, 0.0f);
  cpu::conv2d_forward(out.data(), inp.data(), weight.data(), nullptr, cols.data(), w);
  cpu::conv2d_backward(dinp.data(), dweight.data(), nullptr, dout.data(), inp.data(), weight.data(), cols.data(), w,
                       GradMode::overwrite);
  const DeviceArray<bf16> d_inp = upload<bf16>(inp), d_weight = upload<bf16>(weight), d_dout = upload<bf16>(dout);
  DeviceArray<bf16> d_out(output_size(w)), d_dinp(input_size(w));
  DeviceArray<float> d_dweight(wsize);
  cuda::conv2d_forward<bf16>(d_out.get(), d_inp.get(), d_weight.get(), nullptr, w);
  cuda::conv2d_backward<bf16>(d_dinp.get(), d_dweight.get(), nullptr, d_dout.get(), d_inp.get(), d_weight.get(), w,
                              GradMode::overwrite);
  CHECK(error(download(d_out), out) < 1e-2);
  CHECK(error(download(d_dinp), dinp) < 1e-2);
  CHECK(error(d_dweight.read(), dweight) < weight_grad_tolerance<bf16>());
}

// ---- pooling -----------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: max and average pooling forward and backward match the CPU", E, float, bf16) {
  struct Case {
    int64_t N, C, H, W, kernel, stride, padding;
  };
  // ResNet's 3x3/2 padded stem pool on an odd plane (overlapping windows), 2x2/2, a window
  // of 3 at stride 1, and a global window (7 x 7).
  for (const Case& k : {Case{2, 3, 11, 11, 3, 2, 1}, Case{2, 4, 8, 6, 2, 2, 0}, Case{1, 5, 7, 9, 3, 1, 1},
                       Case{3, 6, 7, 7, 7, 1, 0}}) {
    CAPTURE(k.H);
    CAPTURE(k.kernel);
    CAPTURE(k.stride);
    CAPTURE(k.padding);
    const Window2d w = window(k.N, k.C, k.H, k.W, k.C, k.kernel, k.stride, k.padding, 1);
    const auto inp = rounded<E>(normals(input_size(w), 21));
    const auto dout = rounded<E>(normals(output_size(w), 22));
    const auto before = rounded<E>(normals(input_size(w), 23));
    std::vector<float> out(output_size(w)), dinp = before, avg(output_size(w)), davg = before;
    std::vector<int32_t> argmax(output_size(w));
    cpu::maxpool2d_forward(out.data(), argmax.data(), inp.data(), w);
    cpu::maxpool2d_backward(dinp.data(), dout.data(), argmax.data(), w, GradMode::accumulate);
    cpu::avgpool2d_forward(avg.data(), inp.data(), w);
    cpu::avgpool2d_backward(davg.data(), dout.data(), w, GradMode::accumulate);

    const DeviceArray<E> d_inp = upload<E>(inp), d_dout = upload<E>(dout);
    DeviceArray<E> d_out(output_size(w)), d_dinp = upload<E>(before), d_avg(output_size(w)), d_davg = upload<E>(before);
    DeviceArray<int32_t> d_argmax(output_size(w));
    cuda::maxpool2d_forward(d_out.get(), d_argmax.get(), d_inp.get(), w);
    cuda::maxpool2d_backward(d_dinp.get(), d_dout.get(), d_argmax.get(), w, GradMode::accumulate);
    cuda::avgpool2d_forward(d_avg.get(), d_inp.get(), w);
    cuda::avgpool2d_backward(d_davg.get(), d_dout.get(), w, GradMode::accumulate);
    // The maximum and its place are exact; the max gradient adds the same terms in the
    // same order as the CPU.
    CHECK(download(d_out) == out);
    CHECK(d_argmax.read() == argmax);
    if constexpr (std::is_same_v<E, float>) CHECK(download(d_dinp) == dinp);
    else CHECK(error(download(d_dinp), dinp) < tolerance<E>);
    CHECK(error(download(d_avg), avg) < tolerance<E>);
    CHECK(error(download(d_davg), davg) < tolerance<E>);
    // Overwrite mode starts from zero.
    std::vector<float> fresh(input_size(w));
    cpu::maxpool2d_backward(fresh.data(), dout.data(), argmax.data(), w, GradMode::overwrite);
    cuda::maxpool2d_backward(d_dinp.get(), d_dout.get(), d_argmax.get(), w, GradMode::overwrite);
    CHECK(error(download(d_dinp), fresh) < tolerance<E>);
  }
}

// ---- BatchNorm ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: batchnorm training, running statistics, deferred sums, evaluation and backward", E, float,
                   bf16) {
  struct Case {
    int64_t N, C, plane;
  };
  // Small planes, an odd plane over many samples, a 1 x 1 plane (after global pooling),
  // and one large channel sum.
  for (const Case& k : {Case{4, 3, 25}, Case{7, 5, 33}, Case{16, 8, 1}, Case{8, 2, 3136}}) {
    CAPTURE(k.N);
    CAPTURE(k.C);
    CAPTURE(k.plane);
    const int64_t N = k.N, C = k.C, plane = k.plane;
    const std::size_t n = static_cast<std::size_t>(N * C * plane), c = static_cast<std::size_t>(C);
    auto inp = normals(n, 31, 2.0f);
    for (std::size_t i = 0; i < n; ++i) inp[i] += 0.5f;  // a mean far from 0
    inp = rounded<E>(inp);
    const auto weight = rounded<E>(normals(c, 32)), bias = rounded<E>(normals(c, 33));
    const auto dout = rounded<E>(normals(n, 34));
    const auto running_mean0 = normals(c, 35, 0.1f), running_var0 = std::vector<float>(c, 1.0f);
    const float eps = 1e-5f, momentum = 0.1f;

    std::vector<float> out(n), mean(c), rstd(c), rm = running_mean0, rv = running_var0, dinp(n), dw(c, 0.0f), db(c, 0.0f),
        eval(n);
    std::vector<double> sums(1 + 2 * c, 0.0);
    cpu::batchnorm_forward_train(out.data(), mean.data(), rstd.data(), rm.data(), rv.data(), sums.data(), inp.data(),
                                 weight.data(), bias.data(), N, C, plane, eps, momentum);
    cpu::batchnorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), weight.data(), mean.data(),
                            rstd.data(), N, C, plane, GradMode::overwrite);
    cpu::batchnorm_forward_eval(eval.data(), inp.data(), weight.data(), bias.data(), rm.data(), rv.data(), N, C, plane,
                                eps);
    std::vector<float> applied_mean = running_mean0, applied_var = running_var0;
    cpu::batchnorm_apply_sums(applied_mean.data(), applied_var.data(), sums.data(), C, momentum);

    const DeviceArray<E> d_inp = upload<E>(inp), d_weight = upload<E>(weight), d_bias = upload<E>(bias),
                         d_dout = upload<E>(dout);
    DeviceArray<E> d_out(n), d_dinp(n), d_eval(n);
    DeviceArray<float> d_mean(c), d_rstd(c), d_rm(running_mean0), d_rv(running_var0), d_dw(c), d_db(c);
    DeviceArray<double> d_sums(1 + 2 * c);
    cuda::batchnorm_forward_train(d_out.get(), d_mean.get(), d_rstd.get(), d_rm.get(), d_rv.get(), d_sums.get(),
                                  d_inp.get(), d_weight.get(), d_bias.get(), N, C, plane, eps, momentum);
    cuda::batchnorm_backward(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(), d_weight.get(),
                             d_mean.get(), d_rstd.get(), N, C, plane, GradMode::overwrite);
    cuda::batchnorm_forward_eval(d_eval.get(), d_inp.get(), d_weight.get(), d_bias.get(), d_rm.get(), d_rv.get(), N, C,
                                 plane, eps);
    CHECK(error(download(d_out), out) < tolerance<E>);
    // Statistics in double on both: fp32 results within a rounding or two.
    CHECK(error(d_mean.read(), mean) < 1e-6);
    CHECK(error(d_rstd.read(), rstd) < 1e-6);
    CHECK(error(d_rm.read(), rm) < 1e-6);
    CHECK(error(d_rv.read(), rv) < 1e-6);
    const std::vector<double> gpu_sums = d_sums.read();
    CHECK(gpu_sums[0] == sums[0]);
    for (std::size_t i = 1; i < sums.size(); ++i) CHECK(std::fabs(gpu_sums[i] - sums[i]) <= 1e-9 * (1.0 + std::fabs(sums[i])));
    CHECK(error(download(d_dinp), dinp) < tolerance<E>);
    CHECK(error(d_dw.read(), dw) < gemm_grad_tolerance<E>);
    CHECK(error(d_db.read(), db) < gemm_grad_tolerance<E>);
    CHECK(error(download(d_eval), eval) < tolerance<E>);
    // The deferred rule: the sums applied once.
    DeviceArray<float> d_am(running_mean0), d_av(running_var0);
    cuda::batchnorm_apply_sums(d_am.get(), d_av.get(), d_sums.get(), C, momentum);
    CHECK(error(d_am.read(), applied_mean) < 1e-6);
    CHECK(error(d_av.read(), applied_var) < 1e-6);
    // No running statistics given (a recomputation, or the deferred rule): the output is
    // the same bits.
    DeviceArray<E> d_out2(n);
    cuda::batchnorm_forward_train(d_out2.get(), d_mean.get(), d_rstd.get(), nullptr, nullptr, nullptr, d_inp.get(),
                                  d_weight.get(), d_bias.get(), N, C, plane, eps, momentum);
    CHECK(same_bits(d_out2.read(), d_out.read()));
    // Rectified as it writes (a BatchNorm before a ReLU): relu_forward's bits over the
    // plain output, and the same statistics.
    DeviceArray<E> d_rect(n);
    cuda::batchnorm_forward_train(d_rect.get(), d_mean.get(), d_rstd.get(), nullptr, nullptr, nullptr, d_inp.get(),
                                  d_weight.get(), d_bias.get(), N, C, plane, eps, momentum, true);
    cuda::relu_forward(d_out2.get(), d_out2.get(), static_cast<int64_t>(n));
    CHECK(same_bits(d_rect.read(), d_out2.read()));
    // Rerun: the same bits. Then the parameter gradients alone, accumulated once more.
    DeviceArray<E> d_dinp2(n);
    DeviceArray<float> d_dw2(c), d_db2(c);
    cuda::batchnorm_backward(d_dinp2.get(), d_dw2.get(), d_db2.get(), d_dout.get(), d_inp.get(), d_weight.get(),
                             d_mean.get(), d_rstd.get(), N, C, plane, GradMode::overwrite);
    CHECK(same_bits(d_dinp2.read(), d_dinp.read()));
    CHECK(same_bits(d_dw2.read(), d_dw.read()));
    cuda::batchnorm_backward<E>(nullptr, d_dw2.get(), d_db2.get(), d_dout.get(), d_inp.get(), d_weight.get(),
                                d_mean.get(), d_rstd.get(), N, C, plane, GradMode::accumulate);
    std::vector<float> twice = dw;
    for (float& v : twice) v *= 2.0f;
    CHECK(error(d_dw2.read(), twice) < gemm_grad_tolerance<E>);
  }
}

// ---- layout: skips' concatenation, nearest upsampling, a per-pixel loss's transpose -----

TEST_CASE_TEMPLATE("cuda op: batchnorm's deferred sums gathered in device memory are the host-gathered sums' bits", E,
                   float, bf16) {
  // The layer's way (ops::batchnorm_forward_train with device_sums: one addition per
  // element into a device total, no wait) against the host's as it was before (each
  // micro-batch's sums gathered on the device from zero, copied back and added on the
  // host), over three micro-batches in order.
  const int64_t N = 4, C = 6, plane = 49;
  const std::size_t n = static_cast<std::size_t>(N * C * plane), c = static_cast<std::size_t>(C);
  const DeviceArray<E> d_w(to_elems<E>(rounded<E>(normals(c, 61)))), d_b(to_elems<E>(rounded<E>(normals(c, 62))));
  DeviceArray<E> d_out(to_elems<E>(std::vector<float>(n, 0.0f)));
  DeviceArray<float> d_mean(c), d_rstd(c);
  DeviceArray<double> d_total(std::vector<double>(1 + 2 * c, 0.0));
  std::vector<double> host_total(1 + 2 * c, 0.0);
  const auto on_gpu = [](void* p, Shape s, DType t) { return Tensor{p, s, t, Device::cuda}; };
  const Shape x_shape{N, C, 7, 7}, c_shape{C};
  for (uint32_t micro_batch = 0; micro_batch < 3; ++micro_batch) {
    auto inp = normals(n, 63 + micro_batch, 1.5f);
    for (float& v : inp) v += 0.25f * static_cast<float>(micro_batch);
    const DeviceArray<E> d_in(to_elems<E>(rounded<E>(inp)));
    const Tensor x = on_gpu(d_in.get(), x_shape, dtype_of<E>), y = on_gpu(d_out.get(), x_shape, dtype_of<E>),
                 w = on_gpu(d_w.get(), c_shape, dtype_of<E>), b = on_gpu(d_b.get(), c_shape, dtype_of<E>),
                 mean = on_gpu(d_mean.get(), c_shape, DType::f32), rstd = on_gpu(d_rstd.get(), c_shape, DType::f32);
    DeviceArray<double> d_micro(1 + 2 * c);  // zeroed
    cuda::batchnorm_forward_train(d_out.get(), d_mean.get(), d_rstd.get(), nullptr, nullptr, d_micro.get(), d_in.get(),
                                  d_w.get(), d_b.get(), N, C, plane, 1e-5f, 0.1f);
    const std::vector<double> micro = d_micro.read();
    for (std::size_t i = 0; i < host_total.size(); ++i) host_total[i] += micro[i];
    ops::batchnorm_forward_train(y, mean, rstd, Tensor{}, Tensor{}, std::span<double>(), x, w, b, 1e-5f, 0.1f,
                                 d_total.get());
  }
  const std::vector<double> device_total = d_total.read();
  CHECK(device_total[0] == static_cast<double>(3 * N * plane));
  CHECK(same_bits(device_total, host_total));
  double magnitude = 0;
  for (double v : host_total) magnitude += std::fabs(v);
  CHECK(magnitude > 1.0);  // sums that are not all zero
}

TEST_CASE_TEMPLATE("cuda op: copy_runs and nearest upsampling match the CPU", E, float, bf16) {
  // A concatenation's halves: 3 samples of 4 and 2 channels of 5 x 5 into 6.
  const int64_t N = 3, plane = 25, cx = 4, cs = 2;
  const auto x = rounded<E>(normals(static_cast<std::size_t>(N * cx * plane), 31));
  const auto s = rounded<E>(normals(static_cast<std::size_t>(N * cs * plane), 32));
  const Runs xr{N, cx * plane, (cx + cs) * plane, 0, cx * plane, 0}, sr{N, cs * plane, (cx + cs) * plane, cx * plane, cs * plane, 0};
  std::vector<float> joined(static_cast<std::size_t>(N * (cx + cs) * plane));
  cpu::copy_runs(joined.data(), x.data(), xr);
  cpu::copy_runs(joined.data(), s.data(), sr);
  const DeviceArray<E> d_x = upload<E>(x), d_s = upload<E>(s);
  DeviceArray<E> d_joined(joined.size());
  cuda::copy_runs(d_joined.get(), d_x.get(), xr);
  cuda::copy_runs(d_joined.get(), d_s.get(), sr);
  CHECK(download(d_joined) == joined);  // copies: exact in either type
  // Upsampling by 2 and 3 of (2, 3, 5, 4) planes, and the gradient's block sums.
  for (const int64_t scale : {2, 3}) {
    CAPTURE(scale);
    const int64_t planes = 6, H = 5, W = 4, big = planes * H * W * scale * scale;
    const auto in = rounded<E>(normals(static_cast<std::size_t>(planes * H * W), 33));
    const auto dout = rounded<E>(normals(static_cast<std::size_t>(big), 34));
    std::vector<float> out(static_cast<std::size_t>(big)), dinp(in.size());
    cpu::upsample_nearest_forward(out.data(), in.data(), planes, H, W, scale);
    cpu::upsample_nearest_backward(dinp.data(), dout.data(), planes, H, W, scale);
    const DeviceArray<E> d_in = upload<E>(in), d_dout = upload<E>(dout);
    DeviceArray<E> d_out(out.size()), d_dinp(dinp.size());
    cuda::upsample_nearest_forward(d_out.get(), d_in.get(), planes, H, W, scale);
    cuda::upsample_nearest_backward(d_dinp.get(), d_dout.get(), planes, H, W, scale);
    CHECK(download(d_out) == out);
    // fp32 adds each block in the CPU's order: the same bits; bf16 rounds the sum once.
    if constexpr (std::is_same_v<E, float>) CHECK(download(d_dinp) == dinp);
    else CHECK(error(download(d_dinp), dinp) < tolerance<E>);
  }
}

TEST_CASE_TEMPLATE("cuda op: crossentropy over planes (N, C, H, W), a label per pixel, meets the CPU's", E, float, bf16) {
  // 3 x 5 classes x 300 positions: more than one block of threads, a partial last one.
  const int64_t outer = 3, V = 5, plane = 300, rows = outer * plane;
  const auto logits = rounded<E>(normals(static_cast<std::size_t>(outer * V * plane), 72, 3.0f));
  const auto targets = random_tokens(static_cast<std::size_t>(rows), V, 73);
  const float scale = 1.0f / static_cast<float>(rows);
  std::vector<float> lse(static_cast<std::size_t>(rows)), dlogits(logits.size());
  const double loss = cpu::crossentropy_forward(lse.data(), logits.data(), targets.data(), outer, V, plane);
  cpu::crossentropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), scale, outer, V, plane);

  const DeviceArray<E> d_logits = upload<E>(logits);
  const DeviceArray<int32_t> d_targets(targets);
  DeviceArray<float> d_lse(rows);
  DeviceArray<double> d_loss(1);
  cuda::crossentropy_forward(d_lse.get(), d_loss.get(), d_logits.get(), d_targets.get(), outer, V, plane);
  CHECK(d_loss.read()[0] == doctest::Approx(loss).epsilon(1e-6));
  CHECK(error(d_lse.read(), lse) < fp32_tolerance);
  DeviceArray<E> d_apart(logits.size());
  cuda::crossentropy_backward(d_apart.get(), d_logits.get(), d_lse.get(), d_targets.get(), scale, outer, V, plane);
  CHECK(error(download(d_apart), dlogits) < tolerance<E>);
  // Written over its own logits, as the layer does: the bits of a separate output.
  DeviceArray<E> d_over = upload<E>(logits);
  cuda::crossentropy_backward(d_over.get(), d_over.get(), d_lse.get(), d_targets.get(), scale, outer, V, plane);
  CHECK(same_bits(download(d_over), download(d_apart)));
}

// Rows of at most 32 classes take a thread each (rows.cu's thread_per_row): a classifier's.
TEST_CASE_TEMPLATE("cuda op: crossentropy over rows of few classes (a thread a row) meets the CPU's", E, float, bf16) {
  const int64_t N = 300, V = 10;
  const auto logits = rounded<E>(normals(N * V, 72, 3.0f));
  const auto targets = random_tokens(N, V, 73);
  const float scale = 1.0f / static_cast<float>(N);
  std::vector<float> lse(N), dlogits(N * V);
  const double loss = cpu::crossentropy_forward(lse.data(), logits.data(), targets.data(), N, V);
  cpu::crossentropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), scale, N, V);

  const DeviceArray<E> d_logits = upload<E>(logits);
  const DeviceArray<int32_t> d_targets(targets);
  DeviceArray<float> d_lse(N);
  DeviceArray<double> d_loss(1);
  cuda::crossentropy_forward(d_lse.get(), d_loss.get(), d_logits.get(), d_targets.get(), N, V);
  CHECK(d_loss.read()[0] == doctest::Approx(loss).epsilon(1e-6));
  CHECK(error(d_lse.read(), lse) < fp32_tolerance);
  DeviceArray<E> d_dlogits(N * V);
  cuda::crossentropy_backward(d_dlogits.get(), d_logits.get(), d_lse.get(), d_targets.get(), scale, N, V);
  CHECK(error(download(d_dlogits), dlogits) < tolerance<E>);
}

// ---- channels last -------------------------------------------------------------------------

namespace {
// image_ops.hpp's Memory on the GPU: activations as E, the rest fp32 (the CPU twin is
// its HostMemory, rounding to E).
template <class E>
struct DeviceMemory {
  std::deque<DeviceArray<E>> images;
  std::deque<DeviceArray<float>> values;
  std::deque<DeviceArray<int32_t>> ints;
  Tensor image(const std::vector<float>& v, Shape s) {
    images.emplace_back(to_elems<E>(v));
    return Tensor{images.back().get(), s, dtype_of<E>, Device::cuda};
  }
  Tensor floats(const std::vector<float>& v, Shape s) {
    values.emplace_back(v);
    return Tensor{values.back().get(), s, DType::f32, Device::cuda};
  }
  Tensor indices(Shape s) {
    ints.emplace_back(static_cast<std::size_t>(s.numel()));
    return Tensor{ints.back().get(), s, DType::i32, Device::cuda};
  }
  Tensor scratch(int64_t) { return Tensor{}; }  // a GPU convolution takes no columns from its caller
  std::vector<float> read(const Tensor& t) {
    std::vector<float> out(static_cast<std::size_t>(t.numel()));
    if (t.dtype == DType::bf16) {
      std::vector<bf16> half(out.size());
      cuda::copy_to_host(half.data(), t.data, t.bytes());
      cuda::synchronize(cuda::StreamKind::compute);
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = to_float(half[i]);
    } else {
      cuda::copy_to_host(out.data(), t.data, t.bytes());
      cuda::synchronize(cuda::StreamKind::compute);
    }
    return out;
  }
  float round(float v) const { return rounded<E>(v); }
};
}  // namespace

// Under ctest's cuda.conv_gemm (MPIPE_CONV=gemm) the convolutions take the channels-first
// path through swaps; otherwise cuDNN's NHWC convolutions.
TEST_CASE_TEMPLATE("cuda op: channels last: conv2d, pooling, BatchNorm, upsampling and the swap on NHWC match the CPU", E,
                   float, bf16) {
  cpu::set_threads(2);
  HostMemory cpu_memory;
  cpu_memory.rounding = [](float v) { return rounded<E>(v); };
  const auto reference = run_image_ops(cpu_memory, false);
  DeviceMemory<E> gpu_memory, again_memory;
  const auto gpu = run_image_ops(gpu_memory, true);
  const auto again = run_image_ops(again_memory, true);
  REQUIRE(gpu.size() == reference.size());
  for (const auto& [name, want] : reference) {
    CAPTURE(name);
    REQUIRE(gpu.count(name) == 1);
    const std::vector<float>& got = gpu.at(name);
    const bool weights = name.find("dweight") != std::string::npos;
    CHECK(error(got, want) < (weights ? weight_grad_tolerance<E>() : tolerance<E>));
    // Every run the same bits (no atomics in any of them).
    CHECK(std::memcmp(again.at(name).data(), got.data(), got.size() * sizeof(float)) == 0);
  }
  // The swaps and the max pool's choice are exact.
  CHECK(gpu.at("swapped") == reference.at("swapped"));
  CHECK(gpu.at("swapped back, added") == reference.at("swapped back, added"));
  CHECK(gpu.at("maxpool out") == reference.at("maxpool out"));
}
