// The language-model head split over the vocabulary on the GPU (backend/cuda/vocab.cu,
// nn/vocab_layers.hpp) against the CPU, in fp32 and bf16: each op on the same inputs as
// its CPU twin (the running maximum, the target's logit and the first argmax bit for bit,
// the sums within rounding, the loss's gradient bit for bit), three chunks chained into
// the loss and back, reruns giving the same bits, and the layers themselves with the
// packed (statistics, hidden states) activations in device memory.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "compare.hpp"
#include "device_data.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/backend/ops.hpp"
#include "mpipe/core/arena.hpp"
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/rng.hpp"
#include "mpipe/nn/vocab_layers.hpp"

using namespace mpipe;

using namespace mpipe::test;

namespace {

// Row k (of 4) of statistics (4, N).
std::vector<float> part(const std::vector<float>& stats, int k) {
  const std::size_t N = stats.size() / 4;
  return {stats.begin() + static_cast<std::ptrdiff_t>(k * N), stats.begin() + static_cast<std::ptrdiff_t>((k + 1) * N)};
}

template <class T>
Tensor device_tensor(const DeviceArray<T>& a, Shape shape, DType dtype) {
  return {a.get(), shape, dtype, Device::cuda};
}

// ---- a head as chunks and their loss, on either device -----------------------------------

struct HeadRun {
  double loss = 0, correct = 0;
  std::vector<float> dx, dw;
};

// x (N, C) through `chunks` vocab-chunk layers of w (V, C) and their loss; on the GPU
// (E's activations) when `gpu`, else on the CPU (fp32). `split`: the weight gradients
// through the stash and backward_weight().
template <class E>
HeadRun run_head(bool gpu, const std::vector<float>& x, const std::vector<float>& w, const std::vector<int32_t>& targets,
                 int64_t N, int64_t C, int64_t V, int chunks, bool training, bool split = false) {
  const DType dtype = gpu ? dtype_of<E> : DType::f32;
  const Device device = gpu ? Device::cuda : Device::cpu;
  // The operands where the layers read them: device copies, or the host vectors.
  std::vector<float> host_x = x, host_w = w, host_dw(w.size(), 0.0f), host_dx(x.size(), 0.0f);
  std::vector<int32_t> host_targets = targets;
  std::unique_ptr<DeviceArray<E>> d_x, d_w, d_dx;
  std::unique_ptr<DeviceArray<float>> d_dw;
  std::unique_ptr<DeviceArray<int32_t>> d_targets;
  std::unique_ptr<DeviceArray<double>> d_loss;
  void *px = host_x.data(), *pw = host_w.data(), *pdx = host_dx.data(), *pdw = host_dw.data(), *pt = host_targets.data();
  if (gpu) {
    d_x = std::make_unique<DeviceArray<E>>(to_elems<E>(x));
    d_w = std::make_unique<DeviceArray<E>>(to_elems<E>(w));
    d_dx = std::make_unique<DeviceArray<E>>(x.size());
    d_dw = std::make_unique<DeviceArray<float>>(w.size());
    d_targets = std::make_unique<DeviceArray<int32_t>>(targets);
    d_loss = std::make_unique<DeviceArray<double>>(1);
    px = d_x->get(), pw = d_w->get(), pdx = d_dx->get(), pdw = d_dw->get(), pt = d_targets->get();
  }
  Arena arena(ops::device_memory(device)), stash(ops::device_memory(device));
  Pass pass;
  pass.arena = &arena;
  pass.training = training;
  pass.dtype = dtype;
  pass.targets = {pt, Shape{N}, DType::i32, device};
  pass.loss_scale = 1.0f / static_cast<float>(N);
  if (gpu) pass.device_loss_sum = d_loss->get();
  if (split) pass.stash = &stash;

  std::vector<std::unique_ptr<VocabChunk>> layers;
  for (int c = 0; c < chunks; ++c) {
    // Chunks alternately keep and recompute their logits: the same bits either way.
    layers.push_back(std::make_unique<VocabChunk>(V, c, chunks, C, 0.02f, -1, c % 2 == 1));
    VocabChunk& l = *layers.back();
    const Shape rows{l.end() - l.begin(), C};
    const std::size_t at = static_cast<std::size_t>(l.begin() * C);
    l.bind(std::vector<Tensor>{{static_cast<std::byte*>(pw) + at * dtype_size(dtype), rows, dtype, device}},
           std::vector<Tensor>{{static_cast<float*>(pdw) + at, rows, DType::f32, device}});
  }
  VocabLoss loss(V, C);
  std::vector<Context> ctx(static_cast<std::size_t>(chunks + 1));
  Tensor y{px, Shape{N, C}, dtype, device};
  for (int c = 0; c < chunks; ++c) y = layers[static_cast<std::size_t>(c)]->forward(y, ctx[static_cast<std::size_t>(c)], pass);
  REQUIRE(y.shape == Shape{N, C + 8});
  loss.forward(y, ctx.back(), pass);
  HeadRun out;
  out.loss = gpu ? d_loss->read()[0] : ctx.back().value;
  out.correct = ctx.back().correct;
  if (!training) return out;
  float one = 1.0f;
  Tensor dy = arena.tensor(y.shape, dtype);
  loss.backward(ctx.back(), make_tensor(&one, Shape{1}), dy, GradMode::overwrite, pass);
  for (int c = chunks; c-- > 0;) {
    const Tensor dx = c == 0 ? Tensor{pdx, Shape{N, C}, dtype, device} : arena.tensor(Shape{N, C + 8}, dtype);
    layers[static_cast<std::size_t>(c)]->backward(ctx[static_cast<std::size_t>(c)], dy, dx, GradMode::overwrite, pass);
    dy = dx;
  }
  if (split)
    for (int c = 0; c < chunks; ++c) layers[static_cast<std::size_t>(c)]->backward_weight(ctx[static_cast<std::size_t>(c)], pass);
  if (gpu) {
    out.dx = download(*d_dx);
    out.dw = d_dw->read();
  } else {
    out.dx = host_dx;
    out.dw = host_dw;
  }
  return out;
}

}  // namespace

// ---- the ops -------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: vocab_chunk_forward and backward match the CPU for a chunk inside the vocabulary", E, float,
                   bf16) {
  // Entries [0, 3000) an earlier chunk's, this chunk [3000, 3000 + V): V packed (1000),
  // unpacked (1003) and shorter than a warp (5).
  const int64_t N = 37, v0 = 3000;
  for (const int64_t V : {int64_t{1000}, int64_t{1003}, int64_t{5}}) {
    CAPTURE(V);
    const auto before = rounded<E>(normals(N * v0, 400, 2.0f));
    auto z = rounded<E>(normals(N * V, 401, 2.0f));
    auto targets = random_tokens(N, v0 + V + 1000, 402);  // before, inside and after the chunk
    targets[0] = 3000;
    targets[1] = static_cast<int32_t>(v0 + V - 1);
    targets[2] = 2999;
    targets[3] = static_cast<int32_t>(v0 + V);
    targets[4] = 0;
    std::vector<float> in(4 * N);
    cpu::vocab_chunk_forward(in.data(), nullptr, before.data(), targets.data(), N, v0, 0);
    // Ties. Row 5: its largest entry twice in this chunk (the first wins). Row 6: this
    // chunk's largest equal to the earlier chunks' maximum (theirs wins). Row 8: this
    // chunk's largest above theirs, at its last entry.
    z[5 * V + V / 4] = z[5 * V + V / 2] = 20.0f;
    for (int64_t i = 0; i < V; ++i) z[6 * V + i] *= 0.125f;  // exact: every entry below the earlier maximum
    z[6 * V + V / 3] = in[6];
    z[8 * V + V - 1] = rounded<E>(in[8] + 16.0f);

    std::vector<float> out(4 * N);
    cpu::vocab_chunk_forward(out.data(), in.data(), z.data(), targets.data(), N, V, v0);
    REQUIRE(out[3 * N + 5] == static_cast<float>(v0 + V / 4));
    REQUIRE(out[3 * N + 6] == in[3 * N + 6]);
    REQUIRE(out[3 * N + 8] == static_cast<float>(v0 + V - 1));

    const DeviceArray<E> d_z = upload<E>(z);
    const DeviceArray<float> d_in(in);
    const DeviceArray<int32_t> d_targets(targets);
    DeviceArray<float> d_out(4 * N);
    cuda::vocab_chunk_forward(d_out.get(), d_in.get(), d_z.get(), d_targets.get(), N, V, v0);
    const auto gpu = d_out.read();
    CHECK(same_bits(part(gpu, 0), part(out, 0)));  // m
    CHECK(error(part(gpu, 1), part(out, 1)) < fp32_tolerance);  // s
    CHECK(same_bits(part(gpu, 2), part(out, 2)));  // t
    CHECK(same_bits(part(gpu, 3), part(out, 3)));  // the first largest
    cuda::vocab_chunk_forward(d_out.get(), d_in.get(), d_z.get(), d_targets.get(), N, V, v0);
    CHECK(same_bits(d_out.read(), gpu));  // a rerun gives the same bits

    // The first chunk (no statistics in) over the earlier entries.
    const DeviceArray<E> d_before = upload<E>(before);
    DeviceArray<float> d_first(4 * N);
    cuda::vocab_chunk_forward(d_first.get(), nullptr, d_before.get(), d_targets.get(), N, v0, 0);
    const auto first = d_first.read();
    CHECK(same_bits(part(first, 0), part(in, 0)));
    CHECK(error(part(first, 1), part(in, 1)) < fp32_tolerance);
    CHECK(same_bits(part(first, 2), part(in, 2)));
    CHECK(same_bits(part(first, 3), part(in, 3)));

    // Backward from the CPU's statistics out, so both sides see the same m: ds and dt as
    // the loss would give them; dm and da noise, which must be ignored.
    auto dout = normals(4 * N, 403);
    for (int64_t n = 0; n < N; ++n) dout[N + n] = 1.0f / (static_cast<float>(N) * out[N + n]);
    const DeviceArray<float> d_dout(dout), d_stats_out(out);
    for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
      CAPTURE(static_cast<int>(mode));
      std::vector<float> dz(N * V);
      auto din = normals(4 * N, 404);  // what accumulate adds to
      DeviceArray<E> d_dz(N * V);
      DeviceArray<float> d_din(din);
      cpu::vocab_chunk_backward(dz.data(), din.data(), dout.data(), z.data(), in.data(), out.data(), targets.data(), N,
                                V, v0, mode);
      cuda::vocab_chunk_backward(d_dz.get(), d_din.get(), d_dout.get(), d_z.get(), d_in.get(), d_stats_out.get(),
                                 d_targets.get(), N, V, v0, mode);
      const auto gpu_dz = download(d_dz);
      CHECK(error(gpu_dz, dz) < tolerance<E>);
      const auto gpu_din = d_din.read();
      CHECK(same_bits(part(gpu_din, 0), part(din, 0)));
      CHECK(error(part(gpu_din, 1), part(din, 1)) < fp32_tolerance);
      CHECK(same_bits(part(gpu_din, 2), part(din, 2)));
      CHECK(same_bits(part(gpu_din, 3), part(din, 3)));
      // In place over z, and again: the same bits.
      DeviceArray<E> d_inplace = upload<E>(z);
      cuda::vocab_chunk_backward(d_inplace.get(), nullptr, d_dout.get(), d_inplace.get(), d_in.get(),
                                 d_stats_out.get(), d_targets.get(), N, V, v0, mode);
      CHECK(same_bits(download(d_inplace), gpu_dz));
      cuda::vocab_chunk_backward(d_dz.get(), nullptr, d_dout.get(), d_z.get(), d_in.get(), d_stats_out.get(),
                                 d_targets.get(), N, V, v0, mode);
      CHECK(same_bits(download(d_dz), gpu_dz));
    }
  }
}

TEST_CASE("cuda op: vocab_loss_forward and backward match the CPU, the gradient bit for bit") {
  const int64_t N = 2500;  // more rows than the loss's block has threads
  const int64_t vocab = 50257;
  const auto targets = random_tokens(N, vocab, 410);
  auto stats = normals(4 * N, 411, 3.0f);
  for (int64_t n = 0; n < N; ++n) stats[N + n] = 1.0f + std::fabs(stats[N + n]) * 100.0f;  // s >= 1
  const double loss = cpu::vocab_loss_forward(stats.data(), targets.data(), N, vocab);
  std::vector<float> dstats(4 * N);
  const float scale = 1.0f / static_cast<float>(N);
  cpu::vocab_loss_backward(dstats.data(), stats.data(), scale, N);

  const DeviceArray<float> d_stats(stats);
  DeviceArray<double> d_loss(1);
  cuda::vocab_loss_forward(d_loss.get(), d_stats.get(), N);
  const double first = d_loss.read()[0];
  CHECK(first == doctest::Approx(loss).epsilon(1e-6));
  cuda::vocab_loss_forward(d_loss.get(), d_stats.get(), N);  // adds the same sum again
  CHECK(d_loss.read()[0] == 2.0 * first);
  cuda::vocab_loss_forward(nullptr, d_stats.get(), N);  // a recomputation's: nothing

  DeviceArray<float> d_dstats(normals(4 * N, 412));  // overwritten
  cuda::vocab_loss_backward(d_dstats.get(), d_stats.get(), scale, N);
  CHECK(same_bits(d_dstats.read(), dstats));
}

TEST_CASE_TEMPLATE("cuda op: three vocabulary chunks chained into the loss and back match the CPU, rerun bit for bit", E,
                   float, bf16) {
  const int64_t N = 37, vocab = 3001;
  const int chunks = 3;  // [0, 1000), [1000, 2000), [2000, 3001)
  const auto targets = random_tokens(N, vocab, 420);
  std::vector<std::vector<float>> z;
  std::vector<int64_t> begin, width;
  for (int c = 0; c < chunks; ++c) {
    begin.push_back(c * vocab / chunks);
    width.push_back((c + 1) * vocab / chunks - begin.back());
    z.push_back(rounded<E>(normals(static_cast<std::size_t>(N * width.back()), 421 + static_cast<uint32_t>(c), 2.0f)));
  }
  const float scale = 1.0f / static_cast<float>(N);

  // The CPU: forward, the loss, backward.
  std::vector<std::vector<float>> stats(chunks, std::vector<float>(4 * N)), dstats(chunks, std::vector<float>(4 * N));
  std::vector<std::vector<float>> dz(chunks);
  for (int c = 0; c < chunks; ++c)
    cpu::vocab_chunk_forward(stats[c].data(), c ? stats[c - 1].data() : nullptr, z[c].data(), targets.data(), N, width[c],
                             begin[c]);
  const double loss = cpu::vocab_loss_forward(stats.back().data(), targets.data(), N, vocab);
  cpu::vocab_loss_backward(dstats.back().data(), stats.back().data(), scale, N);
  for (int c = chunks; c-- > 0;) {
    dz[c].resize(static_cast<std::size_t>(N * width[c]));
    cpu::vocab_chunk_backward(dz[c].data(), c ? dstats[c - 1].data() : nullptr, dstats[c].data(), z[c].data(),
                              c ? stats[c - 1].data() : nullptr, stats[c].data(), targets.data(), N, width[c], begin[c],
                              GradMode::overwrite);
  }

  // The GPU, twice: everything it gives, in order, as bytes.
  const DeviceArray<int32_t> d_targets(targets);
  std::vector<std::unique_ptr<DeviceArray<E>>> d_z;
  for (int c = 0; c < chunks; ++c) d_z.push_back(std::make_unique<DeviceArray<E>>(to_elems<E>(z[c])));
  auto run = [&]() {
    std::vector<std::unique_ptr<DeviceArray<float>>> s, ds;
    for (int c = 0; c < chunks; ++c) {
      s.push_back(std::make_unique<DeviceArray<float>>(4 * N));
      ds.push_back(std::make_unique<DeviceArray<float>>(4 * N));
    }
    DeviceArray<double> d_loss(1);
    for (int c = 0; c < chunks; ++c)
      cuda::vocab_chunk_forward(s[c]->get(), c ? s[c - 1]->get() : nullptr, d_z[c]->get(), d_targets.get(), N, width[c],
                                begin[c]);
    cuda::vocab_loss_forward(d_loss.get(), s.back()->get(), N);
    cuda::vocab_loss_backward(ds.back()->get(), s.back()->get(), scale, N);
    std::vector<std::vector<float>> gpu_stats, gpu_dstats, gpu_dz;
    for (int c = chunks; c-- > 0;) {
      DeviceArray<E> d_dz(static_cast<std::size_t>(N * width[c]));
      cuda::vocab_chunk_backward(d_dz.get(), c ? ds[c - 1]->get() : nullptr, ds[c]->get(), d_z[c]->get(),
                                 c ? s[c - 1]->get() : nullptr, s[c]->get(), d_targets.get(), N, width[c], begin[c],
                                 GradMode::overwrite);
      gpu_dz.insert(gpu_dz.begin(), download(d_dz));
    }
    for (int c = 0; c < chunks; ++c) {
      gpu_stats.push_back(s[c]->read());
      gpu_dstats.push_back(ds[c]->read());
    }
    return std::tuple{d_loss.read()[0], gpu_stats, gpu_dstats, gpu_dz};
  };
  const auto [gpu_loss, gpu_stats, gpu_dstats, gpu_dz] = run();
  CHECK(gpu_loss == doctest::Approx(loss).epsilon(1e-6));
  for (int c = 0; c < chunks; ++c) {
    CAPTURE(c);
    CHECK(same_bits(part(gpu_stats[c], 0), part(stats[c], 0)));
    CHECK(error(part(gpu_stats[c], 1), part(stats[c], 1)) < fp32_tolerance);
    CHECK(same_bits(part(gpu_stats[c], 2), part(stats[c], 2)));
    CHECK(same_bits(part(gpu_stats[c], 3), part(stats[c], 3)));
    CHECK(error(part(gpu_dstats[c], 1), part(dstats[c], 1)) < fp32_tolerance);
    CHECK(same_bits(part(gpu_dstats[c], 2), part(dstats[c], 2)));
    CHECK(error(gpu_dz[c], dz[c]) < tolerance<E>);
  }
  const auto [again_loss, again_stats, again_dstats, again_dz] = run();
  CHECK(std::memcmp(&again_loss, &gpu_loss, sizeof(double)) == 0);
  for (int c = 0; c < chunks; ++c) {
    CHECK(same_bits(again_stats[c], gpu_stats[c]));
    CHECK(same_bits(again_dstats[c], gpu_dstats[c]));
    CHECK(same_bits(again_dz[c], gpu_dz[c]));
  }
}

TEST_CASE("cuda op: the Tensor ops of a chunked head on the GPU: the loss into the device sum, the accuracy on the host") {
  const int64_t N = 37, vocab = 1000;
  const auto targets = random_tokens(N, vocab, 430);
  auto stats = normals(4 * N, 431);
  for (int64_t n = 0; n < N; ++n) {
    stats[N + n] = 1.0f + std::fabs(stats[N + n]);
    stats[3 * N + n] = static_cast<float>(n % 3 == 0 ? targets[n] : (targets[n] + 1) % vocab);  // a third right
  }
  const DeviceArray<float> d_stats(stats);
  const DeviceArray<int32_t> d_targets(targets);
  DeviceArray<double> d_loss(1);
  const Tensor s = device_tensor(d_stats, Shape{4, N}, DType::f32), t = device_tensor(d_targets, Shape{N}, DType::i32);
  CHECK(ops::vocab_loss_forward(s, t, vocab, d_loss.get()) == 0.0);
  CHECK(d_loss.read()[0] == doctest::Approx(cpu::vocab_loss_forward(stats.data(), targets.data(), N, vocab)).epsilon(1e-6));
  CHECK(ops::vocab_count_correct(s, t) == cpu::vocab_count_correct(stats.data(), targets.data(), N));
  CHECK(ops::vocab_count_correct(s, t) == (N + 2) / 3);
}

// ---- the layers ------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: a head as vocab-chunk layers on the GPU gives the CPU's loss, dX and dW, and split W the same bits",
                   E, float, bf16) {
  // The logits' scale (about 1) keeps bf16's rounding of them within its tolerance.
  const int64_t N = 37, C = 64, V = 1001;
  const auto x = rounded<E>(normals(N * C, 440));
  const auto w = rounded<E>(normals(V * C, 441, 0.15f));
  const auto targets = random_tokens(N, V, 442);
  for (const int chunks : {1, 3}) {
    CAPTURE(chunks);
    const HeadRun cpu_run = run_head<E>(false, x, w, targets, N, C, V, chunks, true);
    const HeadRun gpu_run = run_head<E>(true, x, w, targets, N, C, V, chunks, true);
    CHECK(gpu_run.loss == doctest::Approx(cpu_run.loss).epsilon(std::is_same_v<E, float> ? 1e-6 : 1e-3));
    CHECK(error(gpu_run.dx, cpu_run.dx) < tolerance<E>);
    CHECK(error(gpu_run.dw, cpu_run.dw) < tolerance<E>);
    // The weight gradient later (zero-bubble schedules) is the same arithmetic; a rerun too.
    const HeadRun split = run_head<E>(true, x, w, targets, N, C, V, chunks, true, true);
    CHECK(std::memcmp(&split.loss, &gpu_run.loss, sizeof(double)) == 0);
    CHECK(same_bits(split.dx, gpu_run.dx));
    CHECK(same_bits(split.dw, gpu_run.dw));
  }
  // Evaluation: the accuracy, some rows made right (their targets' weight rows a multiple
  // of the row's hidden state), the first ten targets apart.
  auto sharp_targets = targets;
  auto sharp = w;
  for (int64_t n = 0; n < 10; ++n) {
    sharp_targets[n] = static_cast<int32_t>(n * 97);
    for (int64_t c = 0; c < C; ++c) sharp[n * 97 * C + c] = rounded<E>(0.5f * x[n * C + c]);
  }
  const HeadRun cpu_eval = run_head<E>(false, x, sharp, sharp_targets, N, C, V, 3, false);
  const HeadRun gpu_eval = run_head<E>(true, x, sharp, sharp_targets, N, C, V, 3, false);
  CHECK(cpu_eval.correct >= 10);
  CHECK(gpu_eval.correct == cpu_eval.correct);
}
