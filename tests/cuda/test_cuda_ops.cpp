// Every CUDA op against its CPU twin (backend/cpu/ops.hpp), in fp32 and bf16: random
// inputs, the same call on both, compared by normalized error ||gpu - cpu|| / ||cpu||.
// The CPU twin is given the bf16-rounded inputs, so the comparison measures the GPU's
// compute error: below 1e-5 in fp32, 1e-2 where bf16 results are stored. Dropout masks,
// single-operation elementwise ops and the ordered embedding sums are compared bit for
// bit, and the ops that reduce are rerun to check they give the same bits.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "compare.hpp"
#include "device_data.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/backend/ops.hpp"
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/rng.hpp"

using namespace mpipe;

using namespace mpipe::test;

// ---- matmul ----------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: matmul_forward matches the CPU, with and without bias", E, float, bf16) {
  struct Shape {
    int64_t N, C, OC;
  };
  for (const Shape s : {Shape{64, 96, 80}, Shape{37, 64, 100}, Shape{5, 33, 7}}) {
    CAPTURE(s.N);
    CAPTURE(s.C);
    CAPTURE(s.OC);
    const auto inp = rounded<E>(normals(s.N * s.C, 1));
    const auto weight = rounded<E>(normals(s.OC * s.C, 2, 0.1f));
    const auto bias = rounded<E>(normals(s.OC, 3));
    const DeviceArray<E> d_inp = upload<E>(inp), d_weight = upload<E>(weight), d_bias = upload<E>(bias);
    for (const bool with_bias : {true, false}) {
      CAPTURE(with_bias);
      std::vector<float> expected(s.N * s.OC);
      cpu::matmul_forward(expected.data(), inp.data(), weight.data(), with_bias ? bias.data() : nullptr, s.N, s.C,
                          s.OC);
      DeviceArray<E> d_out(s.N * s.OC);
      cuda::matmul_forward(d_out.get(), d_inp.get(), d_weight.get(), with_bias ? d_bias.get() : nullptr, s.N, s.C,
                           s.OC);
      CHECK(error(download(d_out), expected) < tolerance<E>);
    }
  }
}

TEST_CASE_TEMPLATE("cuda op: matmul_gelu_forward matches CPU matmul then gelu", E, float, bf16) {
  // OC = 100 is not a multiple of 8: bf16 then takes the unfused path.
  for (const int64_t OC : {int64_t{64}, int64_t{100}}) {
    CAPTURE(OC);
    const int64_t N = 48, C = 72;
    const auto inp = rounded<E>(normals(N * C, 4));
    const auto weight = rounded<E>(normals(OC * C, 5, 0.2f));
    const auto bias = rounded<E>(normals(OC, 6));
    std::vector<float> pre(N * OC), out(N * OC);
    cpu::matmul_forward(pre.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
    cpu::gelu_forward(out.data(), pre.data(), N * OC);
    const DeviceArray<E> d_inp = upload<E>(inp), d_weight = upload<E>(weight), d_bias = upload<E>(bias);
    DeviceArray<E> d_pre(N * OC), d_out(N * OC);
    cuda::matmul_gelu_forward(d_out.get(), d_pre.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C, OC);
    CHECK(error(download(d_pre), pre) < tolerance<E>);
    CHECK(error(download(d_out), out) < tolerance<E>);
  }
}

TEST_CASE("cuda op: matmul_gelu_forward at GPT-2 medium's MLP size in bf16 (N 512, C 1024, OC 4096)") {
  const int64_t N = 512, C = 1024, OC = 4096;
  const auto inp = rounded<bf16>(normals(N * C, 7));
  const auto weight = rounded<bf16>(normals(OC * C, 8, 0.02f));
  const auto bias = rounded<bf16>(normals(OC, 9, 0.1f));
  std::vector<float> pre(N * OC), out(N * OC);
  cpu::matmul_forward(pre.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
  cpu::gelu_forward(out.data(), pre.data(), N * OC);
  const DeviceArray<bf16> d_inp = upload<bf16>(inp), d_weight = upload<bf16>(weight), d_bias = upload<bf16>(bias);
  DeviceArray<bf16> d_pre(N * OC), d_out(N * OC), d_plain(N * OC);
  cuda::matmul_gelu_forward(d_out.get(), d_pre.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C, OC);
  cuda::matmul_forward(d_plain.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C, OC);
  CHECK(error(download(d_pre), pre) < tolerance<bf16>);
  CHECK(error(download(d_out), out) < tolerance<bf16>);
  CHECK(error(download(d_plain), pre) < tolerance<bf16>);
}

TEST_CASE("cuda op: matmul_forward and matmul_backward at GPT-2 small's attention projection size in fp32") {
  const int64_t N = 256, C = 768, OC = 2304;
  const auto inp = normals(N * C, 10), weight = normals(OC * C, 11, 0.02f), bias = normals(OC, 12, 0.1f);
  const auto dout = normals(N * OC, 13);
  std::vector<float> out(N * OC), dinp(N * C), dweight(OC * C), dbias(OC);
  cpu::matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
  cpu::matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), N, C, OC,
                       GradMode::overwrite);
  const DeviceArray<float> d_inp(inp), d_weight(weight), d_bias(bias), d_dout(dout);
  DeviceArray<float> d_out(N * OC), d_dinp(N * C), d_dweight(OC * C), d_dbias(OC);
  cuda::matmul_forward(d_out.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C, OC);
  cuda::matmul_backward(d_dinp.get(), d_dweight.get(), d_dbias.get(), d_dout.get(), d_inp.get(), d_weight.get(), N,
                        C, OC, GradMode::overwrite);
  CHECK(error(d_out.read(), out) < fp32_tolerance);
  CHECK(error(d_dinp.read(), dinp) < fp32_tolerance);
  CHECK(error(d_dweight.read(), dweight) < fp32_tolerance);
  CHECK(error(d_dbias.read(), dbias) < fp32_tolerance);
}

TEST_CASE_TEMPLATE("cuda op: matmul_backward per GradMode, accumulating dweight and dbias", E, float, bf16) {
  const int64_t N = 70, C = 48, OC = 56;
  const auto inp = rounded<E>(normals(N * C, 20));
  const auto weight = rounded<E>(normals(OC * C, 21, 0.2f));
  const auto dout = rounded<E>(normals(N * OC, 22));
  const auto dinp0 = rounded<E>(normals(N * C, 23));
  const auto dweight0 = normals(OC * C, 24), dbias0 = normals(OC, 25);
  const DeviceArray<E> d_inp = upload<E>(inp), d_weight = upload<E>(weight), d_dout = upload<E>(dout);
  for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
    for (const bool with_dbias : {true, false}) {
      CAPTURE(static_cast<int>(mode));
      CAPTURE(with_dbias);
      auto dinp = dinp0, dweight = dweight0, dbias = dbias0;
      cpu::matmul_backward(dinp.data(), dweight.data(), with_dbias ? dbias.data() : nullptr, dout.data(),
                           inp.data(), weight.data(), N, C, OC, mode);
      DeviceArray<E> d_dinp = upload<E>(dinp0);
      DeviceArray<float> d_dweight(dweight0), d_dbias(dbias0);
      cuda::matmul_backward(d_dinp.get(), d_dweight.get(), with_dbias ? d_dbias.get() : nullptr, d_dout.get(),
                            d_inp.get(), d_weight.get(), N, C, OC, mode);
      CHECK(error(download(d_dinp), dinp) < tolerance<E>);
      CHECK(error(d_dweight.read(), dweight) < gemm_grad_tolerance<E>);
      if (with_dbias) CHECK(error(d_dbias.read(), dbias) < fp32_tolerance);
      else CHECK(d_dbias.read() == dbias0);
    }
  }
  // Without dinp only the parameter gradients are written.
  auto dweight = dweight0;
  cpu::matmul_backward(nullptr, dweight.data(), nullptr, dout.data(), inp.data(), weight.data(), N, C, OC,
                       GradMode::overwrite);
  DeviceArray<float> d_dweight(dweight0);
  cuda::matmul_backward<E>(nullptr, d_dweight.get(), nullptr, d_dout.get(), d_inp.get(), d_weight.get(), N, C, OC,
                           GradMode::overwrite);
  CHECK(error(d_dweight.read(), dweight) < gemm_grad_tolerance<E>);
}

// ---- activations -----------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: relu and gelu forward and backward, packed, tail and unaligned", E, float, bf16) {
  const int64_t n = 1003;  // not a multiple of a pack
  const auto x = rounded<E>(normals(n, 30, 2.0f));
  const auto dy = rounded<E>(normals(n, 31));
  const auto d0 = rounded<E>(normals(n, 32));
  // offset 1 starts every pointer off its 16-byte alignment: the unpacked path
  for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
    CAPTURE(offset);
    const int64_t m = n - offset;
    const std::vector<float> xs(x.begin() + offset, x.end()), dys(dy.begin() + offset, dy.end()),
        d0s(d0.begin() + offset, d0.end());
    const DeviceArray<E> d_x = upload<E>(x), d_dy = upload<E>(dy);

    std::vector<float> relu(m), gelu(m);
    cpu::relu_forward(relu.data(), xs.data(), m);
    cpu::gelu_forward(gelu.data(), xs.data(), m);
    DeviceArray<E> d_relu(n), d_gelu(n);
    cuda::relu_forward(d_relu.get() + offset, d_x.get() + offset, m);
    cuda::gelu_forward(d_gelu.get() + offset, d_x.get() + offset, m);
    const auto g_relu = download(d_relu), g_gelu = download(d_gelu);
    CHECK(error({g_relu.begin() + offset, g_relu.end()}, relu) < tolerance<E>);
    CHECK(error({g_gelu.begin() + offset, g_gelu.end()}, gelu) < tolerance<E>);

    for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
      CAPTURE(static_cast<int>(mode));
      auto drelu = d0s, dgelu = d0s;
      cpu::relu_backward(drelu.data(), dys.data(), relu.data(), m, mode);
      cpu::gelu_backward(dgelu.data(), dys.data(), xs.data(), m, mode);
      DeviceArray<E> d_drelu = upload<E>(d0), d_dgelu = upload<E>(d0);
      cuda::relu_backward(d_drelu.get() + offset, d_dy.get() + offset, d_relu.get() + offset, m, mode);
      cuda::gelu_backward(d_dgelu.get() + offset, d_dy.get() + offset, d_x.get() + offset, m, mode);
      const auto g_drelu = download(d_drelu), g_dgelu = download(d_dgelu);
      CHECK(error({g_drelu.begin() + offset, g_drelu.end()}, drelu) < tolerance<E>);
      CHECK(error({g_dgelu.begin() + offset, g_dgelu.end()}, dgelu) < tolerance<E>);
    }
  }
  // gelu_backward in place (dinp aliasing dout), as the MLP block calls it.
  std::vector<float> dgelu(n);
  cpu::gelu_backward(dgelu.data(), dy.data(), x.data(), n, GradMode::overwrite);
  const DeviceArray<E> d_x = upload<E>(x);
  DeviceArray<E> d_dy = upload<E>(dy);
  cuda::gelu_backward(d_dy.get(), d_dy.get(), d_x.get(), n, GradMode::overwrite);
  CHECK(error(download(d_dy), dgelu) < tolerance<E>);
}

// ---- layernorm -------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: layernorm forward and backward", E, float, bf16) {
  struct Shape {
    int64_t N, C;
  };
  for (const Shape s : {Shape{37, 768}, Shape{64, 99}}) {  // packed rows, then unpacked
    CAPTURE(s.N);
    CAPTURE(s.C);
    const int64_t N = s.N, C = s.C;
    const auto inp = rounded<E>(normals(N * C, 40, 3.0f));
    const auto weight = rounded<E>(normals(C, 41, 0.5f));
    const auto bias = rounded<E>(normals(C, 42));
    const auto dout = rounded<E>(normals(N * C, 43));
    const auto dinp0 = rounded<E>(normals(N * C, 44));
    const auto dweight0 = normals(C, 45), dbias0 = normals(C, 46);

    std::vector<float> out(N * C), mean(N), rstd(N);
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);
    const DeviceArray<E> d_inp = upload<E>(inp), d_weight = upload<E>(weight), d_bias = upload<E>(bias),
                         d_dout = upload<E>(dout);
    DeviceArray<E> d_out(N * C);
    DeviceArray<float> d_mean(N), d_rstd(N);
    cuda::layernorm_forward(d_out.get(), d_mean.get(), d_rstd.get(), d_inp.get(), d_weight.get(), d_bias.get(), N,
                            C);
    CHECK(error(download(d_out), out) < tolerance<E>);
    CHECK(error(d_mean.read(), mean) < fp32_tolerance);
    CHECK(error(d_rstd.read(), rstd) < fp32_tolerance);

    for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
      CAPTURE(static_cast<int>(mode));
      auto dinp = dinp0, dweight = dweight0, dbias = dbias0;
      cpu::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(),
                              mean.data(), rstd.data(), N, C, mode);
      DeviceArray<E> d_dinp = upload<E>(dinp0);
      DeviceArray<float> d_dweight(dweight0), d_dbias(dbias0);
      cuda::layernorm_backward(d_dinp.get(), d_dweight.get(), d_dbias.get(), d_dout.get(), d_inp.get(),
                               d_weight.get(), d_mean.get(), d_rstd.get(), N, C, mode);
      CHECK(error(download(d_dinp), dinp) < tolerance<E>);
      CHECK(error(d_dweight.read(), dweight) < fp32_tolerance);
      CHECK(error(d_dbias.read(), dbias) < fp32_tolerance);
    }
    // With a residual (a residual block's other branch): dinp = residual + the input
    // gradient in one pass, the bits of accumulating onto a copy of the residual, and the
    // CPU's sum.
    const auto residual = rounded<E>(normals(N * C, 47));
    auto dinp = residual, dweight = dweight0, dbias = dbias0;
    cpu::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(),
                            mean.data(), rstd.data(), N, C, GradMode::accumulate);
    const DeviceArray<E> d_residual = upload<E>(residual);
    DeviceArray<E> d_onto = upload<E>(dinp0), d_copied = upload<E>(residual);
    DeviceArray<float> d_dweight1(dweight0), d_dbias1(dbias0), d_dweight2(dweight0), d_dbias2(dbias0);
    cuda::layernorm_backward(d_onto.get(), d_dweight1.get(), d_dbias1.get(), d_dout.get(), d_inp.get(), d_weight.get(),
                             d_mean.get(), d_rstd.get(), N, C, GradMode::overwrite, d_residual.get());
    cuda::layernorm_backward(d_copied.get(), d_dweight2.get(), d_dbias2.get(), d_dout.get(), d_inp.get(),
                             d_weight.get(), d_mean.get(), d_rstd.get(), N, C, GradMode::accumulate);
    CHECK(same_bits(d_onto.read(), d_copied.read()));
    CHECK(same_bits(d_dweight1.read(), d_dweight2.read()));
    CHECK(error(download(d_onto), dinp) < tolerance<E>);
  }
}

// ---- embedding -------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: embedding forward, and backward summing repeated tokens in the CPU's order", E, float,
                   bf16) {
  const int64_t B = 4, T = 33, V = 17;  // 132 positions over 17 tokens: many repeats
  for (const int64_t C : {int64_t{96}, int64_t{99}}) {  // packed rows, then unpacked
    CAPTURE(C);
    const auto tokens = random_tokens(B * T, V, 50);
    const auto wte = rounded<E>(normals(V * C, 51)), wpe = rounded<E>(normals(T * C, 52));
    const auto dout = rounded<E>(normals(B * T * C, 53));
    std::vector<float> out(B * T * C);
    cpu::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V);
    const DeviceArray<int32_t> d_tokens(tokens);
    const DeviceArray<E> d_wte = upload<E>(wte), d_wpe = upload<E>(wpe), d_dout = upload<E>(dout);
    DeviceArray<E> d_out(B * T * C);
    cuda::embedding_forward(d_out.get(), d_tokens.get(), d_wte.get(), d_wpe.get(), B, T, C, V);
    CHECK(error(download(d_out), out) < tolerance<E>);

    // Gradients accumulate onto what is there, row by row in position order: the same
    // fp32 additions as the CPU, so the same bits.
    auto dwte = normals(V * C, 54), dwpe = normals(T * C, 55);
    DeviceArray<float> d_dwte(dwte), d_dwpe(dwpe);
    cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
    cuda::embedding_backward(d_dwte.get(), d_dwpe.get(), d_dout.get(), d_tokens.get(), B, T, C, V);
    CHECK(d_dwte.read() == dwte);
    CHECK(d_dwpe.read() == dwpe);
  }
}

// ---- attention -------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: attention forward (out, lse) and backward (dqkv)", E, float, bf16) {
  struct Shape {
    int64_t B, T, C, H;
  };
  // hs 32, then T = 37, then hs 20 (unpacked head copies in bf16) with T > 128
  for (const Shape s : {Shape{2, 64, 128, 4}, Shape{2, 37, 128, 4}, Shape{1, 130, 60, 3}}) {
    CAPTURE(s.B);
    CAPTURE(s.T);
    CAPTURE(s.C);
    CAPTURE(s.H);
    const int64_t B = s.B, T = s.T, C = s.C, H = s.H;
    const auto qkv = rounded<E>(normals(B * T * 3 * C, 60));
    const auto dout = rounded<E>(normals(B * T * C, 61));
    std::vector<float> out(B * T * C), lse(B * H * T), dqkv(B * T * 3 * C);
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, H, H);
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, H, H);

    const DeviceArray<E> d_qkv = upload<E>(qkv), d_dout = upload<E>(dout);
    DeviceArray<E> d_out(B * T * C), d_dqkv(B * T * 3 * C);
    DeviceArray<float> d_lse(B * H * T);
    cuda::attention_forward(d_out.get(), d_lse.get(), d_qkv.get(), B, T, C, H, H);
    cuda::attention_backward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(), d_lse.get(), B, T, C, H, H);
    CHECK(error(download(d_out), out) < tolerance<E>);
    CHECK(error(d_lse.read(), attention_lse(qkv, B, T, C, H)) < fp32_tolerance);
    CHECK(error(lse, attention_lse(qkv, B, T, C, H)) < fp32_tolerance);
    CHECK(error(download(d_dqkv), dqkv) < tolerance<E>);
  }
}

// ---- cross-entropy ---------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: crossentropy forward (lse, loss sum) and backward", E, float, bf16) {
  const int64_t N = 37, V = 1003;  // V not a multiple of 32
  const auto logits = rounded<E>(normals(N * V, 70, 3.0f));
  const auto targets = random_tokens(N, V, 71);
  const float scale = 1.0f / static_cast<float>(N);
  std::vector<float> lse(N), dlogits(N * V);
  const double loss = cpu::crossentropy_forward(lse.data(), logits.data(), targets.data(), N, V);
  cpu::crossentropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), scale, N, V);

  const DeviceArray<E> d_logits = upload<E>(logits);
  const DeviceArray<int32_t> d_targets(targets);
  DeviceArray<float> d_lse(N);
  DeviceArray<double> d_loss(1);
  cuda::crossentropy_forward(d_lse.get(), d_loss.get(), d_logits.get(), d_targets.get(), N, V);
  const double first = d_loss.read()[0];
  CHECK(first == doctest::Approx(loss).epsilon(1e-6));
  CHECK(error(d_lse.read(), lse) < fp32_tolerance);
  // A second call adds the same sum again.
  cuda::crossentropy_forward(d_lse.get(), d_loss.get(), d_logits.get(), d_targets.get(), N, V);
  CHECK(d_loss.read()[0] == 2.0 * first);

  DeviceArray<E> d_dlogits(N * V);
  cuda::crossentropy_backward(d_dlogits.get(), d_logits.get(), d_lse.get(), d_targets.get(), scale, N, V);
  CHECK(error(download(d_dlogits), dlogits) < tolerance<E>);
}

// ---- dropout ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: dropout_apply draws the CPU's masks bit for bit", E, float, bf16) {
  const int64_t B = 3;
  const float p = 0.1f;
  const DropoutKey key{7, 5, 11, 35};
  for (const int64_t per_sample : {int64_t{1001}, int64_t{1024}}) {  // unpacked, then packed
    CAPTURE(per_sample);
    const auto x = rounded<E>(normals(B * per_sample, 80));
    std::vector<float> y(B * per_sample);
    cpu::dropout_apply(y.data(), x.data(), B, per_sample, p, key);
    const auto expected = to_elems<E>(y);

    const DeviceArray<E> d_x = upload<E>(x);
    DeviceArray<E> d_y(B * per_sample);
    cuda::dropout_apply(d_y.get(), d_x.get(), B, per_sample, p, key);
    CHECK(same_bits(d_y.read(), expected));
    // In place gives the same.
    DeviceArray<E> d_inplace = upload<E>(x);
    cuda::dropout_apply(d_inplace.get(), d_inplace.get(), B, per_sample, p, key);
    CHECK(same_bits(d_inplace.read(), expected));

    int64_t dropped = 0;
    for (float v : y) dropped += v == 0.0f;
    CHECK(dropped > 0.05 * B * per_sample);
    CHECK(dropped < 0.15 * B * per_sample);
  }
}

// ---- elementwise -----------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: add, copy and scale are the CPU's single operations", E, float, bf16) {
  const int64_t n = 1003;
  const auto x = rounded<E>(normals(n, 90)), y0 = rounded<E>(normals(n, 91));
  const DeviceArray<E> d_x = upload<E>(x);

  auto added = y0;
  cpu::add(added.data(), x.data(), n);
  DeviceArray<E> d_added = upload<E>(y0);
  cuda::add(d_added.get(), d_x.get(), n);
  CHECK(same_bits(d_added.read(), to_elems<E>(added)));

  DeviceArray<E> d_copied(n);
  cuda::copy(d_copied.get(), d_x.get(), n);
  CHECK(same_bits(d_copied.read(), to_elems<E>(x)));

  auto scaled = y0;
  cpu::scale(scaled.data(), 0.37f, n);
  DeviceArray<E> d_scaled = upload<E>(y0);
  cuda::scale(d_scaled.get(), 0.37f, n);
  CHECK(same_bits(d_scaled.read(), to_elems<E>(scaled)));
}

TEST_CASE("cuda op: convert rounds to bf16 as the host does, and widens exactly") {
  auto x = normals(1003, 100, 10.0f);
  const float specials[] = {0.0f, -0.0f, 1e-40f, -3e-39f, 3.4e38f, -3.4e38f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 1.00390625f, 1.01171875f};
  x.insert(x.end(), std::begin(specials), std::end(specials));
  const int64_t n = static_cast<int64_t>(x.size());
  const DeviceArray<float> d_x(x);
  DeviceArray<bf16> d_narrow(n);
  cuda::convert(d_narrow.get(), d_x.get(), n);
  const auto narrow = d_narrow.read();
  CHECK(same_bits(narrow, to_elems<bf16>(x)));
  DeviceArray<float> d_wide(n);
  cuda::convert(d_wide.get(), d_narrow.get(), n);
  CHECK(same_bits(d_wide.read(), to_floats(narrow)));
}

// ---- reductions and optimizers ---------------------------------------------------------

TEST_CASE("cuda op: sum_squares of many spans in one launch") {
  const std::vector<int64_t> sizes{0, 1, 1000, 4099, 100003, 7};
  const std::vector<int64_t> offsets{5, 5, 6, 1200, 5400, 105403};
  const auto x = normals(105410, 110);
  const int count = static_cast<int>(sizes.size());
  const DeviceArray<float> d_x(x);
  const DeviceArray<int64_t> d_offsets(offsets), d_sizes(sizes);
  DeviceArray<double> d_out(count);
  cuda::sum_squares(d_out.get(), d_x.get(), d_offsets.get(), d_sizes.get(), count);
  const auto out = d_out.read();
  for (int i = 0; i < count; ++i) {
    CAPTURE(i);
    const double expected = cpu::sum_squares(x.data() + offsets[i], sizes[i]);
    if (sizes[i] == 0) CHECK(out[i] == 0.0);
    else CHECK(out[i] == doctest::Approx(expected).epsilon(1e-12));
  }
}

TEST_CASE("cuda op: the flat-store Tensor ops (scale, transfer, SpanSums) are the CPU's") {
  const std::vector<int64_t> sizes{0, 1, 1000, 4099, 7};
  const std::vector<int64_t> offsets{5, 5, 6, 1200, 5400};
  const auto x = normals(5410, 111);
  const Shape all{static_cast<int64_t>(x.size())};
  // transfer: host -> device -> device -> host, every bit.
  const DeviceArray<float> d_a(x.size()), d_b(x.size());
  std::vector<float> back(x.size());
  ops::transfer(Tensor{d_a.get(), all, DType::f32, Device::cuda}, make_tensor(const_cast<float*>(x.data()), all));
  ops::transfer(Tensor{d_b.get(), all, DType::f32, Device::cuda}, Tensor{d_a.get(), all, DType::f32, Device::cuda});
  ops::transfer(make_tensor(back.data(), all), Tensor{d_b.get(), all, DType::f32, Device::cuda});
  CHECK(std::memcmp(back.data(), x.data(), x.size() * sizeof(float)) == 0);
  // scale: as cpu::scale.
  auto scaled = x;
  ops::scale(make_tensor(scaled.data(), all), 0.37f);
  ops::scale(Tensor{d_b.get(), all, DType::f32, Device::cuda}, 0.37f);
  CHECK(same_bits(d_b.read(), scaled));
  // SpanSums: the per-span sums of a device buffer as of a host one (one launch against
  // one pass per span, in its own fixed order each).
  ops::SpanSums on_cpu(Device::cpu, offsets, sizes), on_gpu(Device::cuda, offsets, sizes);
  const std::vector<double> expected = [&] {
    const auto s = on_cpu.sums(make_tensor(const_cast<float*>(x.data()), all));
    return std::vector<double>(s.begin(), s.end());
  }();
  const std::span<const double> got = on_gpu.sums(Tensor{d_a.get(), all, DType::f32, Device::cuda});
  REQUIRE(got.size() == sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CAPTURE(i);
    CHECK(expected[i] == cpu::sum_squares(x.data() + offsets[i], sizes[i]));  // the same function: exact
    CHECK(got[i] == doctest::Approx(expected[i]).epsilon(1e-12));
  }
}

namespace {

// Three views at different places in params, in grads and in the state (packed
// elsewhere, as a sharded optimizer's), with different decay; params has gaps between
// the views that must stay untouched.
struct Views {
  std::vector<int64_t> param_offsets{5, 2000, 3500}, offsets{0, 1003, 1503}, state_offsets{16, 1040, 1552},
      sizes{1003, 500, 777};
  std::vector<float> decay{0.1f, 0.0f, 0.01f};
  int64_t params = 4300, grads = 2280, state = 2400;
  DeviceArray<int64_t> d_param_offsets{param_offsets}, d_offsets{offsets}, d_state_offsets{state_offsets}, d_sizes{sizes};
  DeviceArray<float> d_decay{decay};

  cuda::ViewTable table() const {
    cuda::ViewTable t;
    t.param_offsets = d_param_offsets.get();
    t.offsets = d_offsets.get();
    t.state_offsets = d_state_offsets.get();
    t.sizes = d_sizes.get();
    t.weight_decay = d_decay.get();
    t.count = static_cast<int>(sizes.size());
    t.largest = 1003;
    return t;
  }
};

// The bf16 copy an update writes as it goes: each view's elements are the updated
// values as convert() rounds them; elements between views keep what they held (here a
// marker, 7).
void check_copy(const Views& views, const std::vector<float>& updated, const std::vector<bf16>& copy) {
  std::vector<bool> in_view(updated.size(), false);
  for (std::size_t i = 0; i < views.sizes.size(); ++i)
    for (int64_t j = 0; j < views.sizes[i]; ++j) in_view[static_cast<std::size_t>(views.param_offsets[i] + j)] = true;
  std::size_t wrong = 0;
  for (std::size_t j = 0; j < updated.size(); ++j)
    if (copy[j].bits != (in_view[j] ? to_bf16(updated[j]) : to_bf16(7.0f)).bits) ++wrong;
  CHECK(wrong == 0);
}

}  // namespace

TEST_CASE("cuda op: adamw_update over several views for several steps, and its bf16 copy") {
  const Views views;
  auto params = normals(views.params, 120), m = std::vector<float>(views.state), v = m;
  DeviceArray<float> d_params(params), d_m(views.state), d_v(views.state);
  DeviceArray<bf16> d_copy(std::vector<bf16>(static_cast<std::size_t>(views.params), to_bf16(7.0f)));
  const auto untouched = params;
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  for (int64_t step = 1; step <= 3; ++step) {
    const auto grads = normals(views.grads, 121 + static_cast<uint32_t>(step));
    for (std::size_t i = 0; i < views.sizes.size(); ++i) {
      const int64_t at = views.offsets[i], state = views.state_offsets[i];
      cpu::adamw_update(params.data() + views.param_offsets[i], grads.data() + at, m.data() + state, v.data() + state,
                        views.sizes[i], lr, beta1, beta2, eps, views.decay[i], step);
    }
    const DeviceArray<float> d_grads(grads);
    cuda::adamw_update(d_params.get(), d_grads.get(), d_m.get(), d_v.get(), views.table(), lr, beta1, beta2, eps,
                       step, d_copy.get());
  }
  const auto g_params = d_params.read();
  CHECK(error(g_params, params) < fp32_tolerance);
  CHECK(error(d_m.read(), m) < fp32_tolerance);
  CHECK(error(d_v.read(), v) < fp32_tolerance);
  CHECK(g_params[4] == untouched[4]);
  CHECK(g_params[1500] == untouched[1500]);
  CHECK(g_params[4299] == untouched[4299]);
  CHECK(g_params[5] != untouched[5]);
  check_copy(views, g_params, d_copy.read());
}

TEST_CASE("cuda op: sgd_update over several views for several steps, and its bf16 copy") {
  const Views views;
  auto params = normals(views.params, 130), velocity = std::vector<float>(views.state);
  DeviceArray<float> d_params(params), d_velocity(views.state);
  DeviceArray<bf16> d_copy(std::vector<bf16>(static_cast<std::size_t>(views.params), to_bf16(7.0f)));
  const auto untouched = params;
  const float lr = 0.05f, momentum = 0.9f;
  for (int64_t step = 1; step <= 3; ++step) {
    const auto grads = normals(views.grads, 131 + static_cast<uint32_t>(step));
    for (std::size_t i = 0; i < views.sizes.size(); ++i) {
      const int64_t at = views.offsets[i], state = views.state_offsets[i];
      cpu::sgd_update(params.data() + views.param_offsets[i], grads.data() + at, velocity.data() + state,
                      views.sizes[i], lr, momentum, views.decay[i]);
    }
    const DeviceArray<float> d_grads(grads);
    cuda::sgd_update(d_params.get(), d_grads.get(), d_velocity.get(), views.table(), lr, momentum, d_copy.get());
  }
  const auto g_params = d_params.read();
  CHECK(error(g_params, params) < fp32_tolerance);
  CHECK(error(d_velocity.read(), velocity) < fp32_tolerance);
  CHECK(g_params[4] == untouched[4]);
  CHECK(g_params[1500] == untouched[1500]);
  CHECK(g_params[5] != untouched[5]);
  check_copy(views, g_params, d_copy.read());
}

// ---- determinism -----------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: reducing backward ops give the same bits when rerun", E, float, bf16) {
  const int64_t B = 4, T = 64, C = 128, H = 4, V = 50;
  const int64_t N = B * T;
  const auto tokens = random_tokens(N, V, 140);
  const DeviceArray<int32_t> d_tokens(tokens);
  const DeviceArray<E> d_dout = upload<E>(normals(N * C, 141)), d_inp = upload<E>(normals(N * C, 142)),
                       d_weight = upload<E>(normals(C, 143)), d_bias = upload<E>(normals(C, 144)),
                       d_qkv = upload<E>(normals(N * 3 * C, 145));
  DeviceArray<E> d_ln(N * C), d_att(N * C);
  DeviceArray<float> d_mean(N), d_rstd(N), d_lse(B * H * T);
  cuda::layernorm_forward(d_ln.get(), d_mean.get(), d_rstd.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C);
  cuda::attention_forward(d_att.get(), d_lse.get(), d_qkv.get(), B, T, C, H, H);

  struct Run {
    std::vector<float> dwte, dwpe, dweight, dbias;
    std::vector<E> dinp, dqkv;
  };
  const auto run = [&] {
    DeviceArray<float> dwte(V * C), dwpe(T * C), dweight(C), dbias(C);
    DeviceArray<E> dinp(N * C), dqkv(N * 3 * C);
    cuda::embedding_backward(dwte.get(), dwpe.get(), d_dout.get(), d_tokens.get(), B, T, C, V);
    cuda::layernorm_backward(dinp.get(), dweight.get(), dbias.get(), d_dout.get(), d_inp.get(), d_weight.get(),
                             d_mean.get(), d_rstd.get(), N, C, GradMode::overwrite);
    cuda::attention_backward(dqkv.get(), d_dout.get(), d_qkv.get(), d_att.get(), d_lse.get(), B, T, C, H, H);
    return Run{dwte.read(), dwpe.read(), dweight.read(), dbias.read(), dinp.read(), dqkv.read()};
  };
  const Run first = run(), second = run();
  CHECK(same_bits(first.dwte, second.dwte));
  CHECK(same_bits(first.dwpe, second.dwpe));
  CHECK(same_bits(first.dweight, second.dweight));
  CHECK(same_bits(first.dbias, second.dbias));
  CHECK(same_bits(first.dinp, second.dinp));
  CHECK(same_bits(first.dqkv, second.dqkv));
  // Nothing above is trivially equal: the gradients are not all zero.
  double norm = 0.0;
  for (float g : first.dwte) norm += static_cast<double>(g) * g;
  CHECK(norm > 0.0);
}
