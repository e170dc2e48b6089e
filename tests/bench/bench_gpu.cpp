// GPU benchmark (scripts/bench_gpu.sh): the measured bf16 GEMM rate of this GPU, then
// per-op and whole-step throughput of a GPT-2-medium-sized stage in bf16 as a fraction
// of that rate (model FLOPs utilisation), a Llama block's own ops at the same size
// (grouped-query attention with --kv-heads, RMSNorm, RoPE, SwiGLU), and convolution and
// BatchNorm at ResNet-50's shapes. Prints a Markdown table; exits 77 without a GPU.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "mpipe/app/config.hpp"
#include "mpipe/backend/cuda/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/nn/transformer_layers.hpp"
#include "mpipe/pipeline/run/executor.hpp"

using namespace mpipe;

namespace {

// Median GPU seconds of `body` over `repeats` runs after two warm-ups, by CUDA events.
double time_gpu(const std::function<void()>& body, int repeats) {
  for (int i = 0; i < 2; ++i) body();
  std::vector<double> seconds;
  cuda::Event start(true), end(true);
  for (int i = 0; i < repeats; ++i) {
    start.record(cuda::StreamKind::compute);
    body();
    end.record(cuda::StreamKind::compute);
    end.synchronize();
    seconds.push_back(cuda::seconds_between(start, end));
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

// A device buffer of n bf16 values, filled with small numbers (the values do not
// change a GEMM's speed, but NaNs could change an epilogue's).
cuda::DeviceBuffer bf16_buffer(std::int64_t n) {
  cuda::DeviceBuffer buffer(static_cast<std::size_t>(n) * sizeof(bf16));
  cuda::DeviceBuffer ones(static_cast<std::size_t>(n) * sizeof(float));
  std::vector<float> host(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) host[i] = 0.01f * static_cast<float>((i * 2654435761u) % 200) - 1.0f;
  cuda::copy_to_device(ones.data(), host.data(), host.size() * sizeof(float));
  cuda::convert(buffer.as<bf16>(), ones.as<float>(), n);
  cuda::synchronize(cuda::StreamKind::compute);
  return buffer;
}

struct Row {
  std::string what;
  double seconds, flops, bytes;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  CLI::App app{"mpipe GPU benchmark"};
  int batch = 8, seq = 1024, channels = 1024, heads = 16, layers = 24, vocab = 50257, micro_batches = 4, steps = 5;
  int kv_heads = 4;
  int repeats = 20;
  app.add_option("--batch", batch, "Micro-batch, in samples")->capture_default_str();
  app.add_option("--seq-len", seq)->capture_default_str();
  app.add_option("--d-model", channels)->capture_default_str();
  app.add_option("--heads", heads)->capture_default_str();
  app.add_option("--kv-heads", kv_heads, "Key/value heads of the grouped-query attention rows")->capture_default_str();
  app.add_option("--layers", layers, "Blocks in the whole-step stage")->capture_default_str();
  app.add_option("--vocab", vocab)->capture_default_str();
  app.add_option("--micro-batches", micro_batches)->capture_default_str();
  app.add_option("--steps", steps, "Timed training steps")->capture_default_str();
  app.add_option("--repeats", repeats, "Timed runs per op")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  std::string why;
  const int gpus = cuda::device_count(&why);
  if (gpus == 0) {
    std::printf("SKIPPED: no usable GPU (%s)\n", why.c_str());
    MPI_Finalize();
    return 77;
  }
  cuda::init(0);
  const cuda::DeviceProperties props = cuda::properties(0);
  std::printf("GPU: %s (sm_%d%d, %d SMs, %zu GiB)\n\n", props.name.c_str(), props.major, props.minor,
              props.multiprocessors, props.memory_bytes >> 30);

  // The reference rate: a large square bf16 GEMM through the same op the layers use.
  const std::int64_t S = 8192;
  double peak = 0;
  {
    cuda::DeviceBuffer a = bf16_buffer(S * S), b = bf16_buffer(S * S), c = bf16_buffer(S * S);
    const double s = time_gpu([&] { cuda::matmul_forward(c.as<bf16>(), a.as<bf16>(), b.as<bf16>(), (const bf16*)nullptr, S, S, S); }, repeats);
    peak = 2.0 * S * S * S / s;
  }
  std::printf("measured bf16 GEMM rate (%lld^3, cuBLASLt): %.1f TFLOP/s\n\n", static_cast<long long>(S), peak / 1e12);

  // Per op, at one block of the configured size.
  const std::int64_t B = batch, T = seq, C = channels, H = heads, N = B * T, V = vocab;
  std::vector<Row> rows;
  {
    cuda::DeviceBuffer x = bf16_buffer(N * C), qkv = bf16_buffer(N * 3 * C), wide = bf16_buffer(N * 4 * C),
                       pre = bf16_buffer(N * 4 * C), y = bf16_buffer(N * C), dqkv = bf16_buffer(N * 3 * C);
    cuda::DeviceBuffer w_qkv = bf16_buffer(3 * C * C), b_qkv = bf16_buffer(3 * C), w_fc = bf16_buffer(4 * C * C),
                       b_fc = bf16_buffer(4 * C), w_proj = bf16_buffer(4 * C * C), b_proj = bf16_buffer(C),
                       ln_w = bf16_buffer(C), ln_b = bf16_buffer(C);
    cuda::DeviceBuffer dw(static_cast<std::size_t>(4 * C * C) * 4), db(static_cast<std::size_t>(4 * C) * 4),
        mean(static_cast<std::size_t>(N) * 4), rstd(static_cast<std::size_t>(N) * 4),
        lse(static_cast<std::size_t>(B * H * T) * 4), dln(static_cast<std::size_t>(2 * C) * 4);
    auto p = [](cuda::DeviceBuffer& d) { return d.as<bf16>(); };
    const double gemm = 2.0 * N * C;
    rows.push_back({"matmul qkv forward (C to 3C)", time_gpu([&] { cuda::matmul_forward(p(qkv), p(x), p(w_qkv), p(b_qkv), N, C, 3 * C); }, repeats), gemm * 3 * C, 0});
    rows.push_back({"matmul+GELU forward (C to 4C)", time_gpu([&] { cuda::matmul_gelu_forward(p(wide), p(pre), p(x), p(w_fc), p(b_fc), N, C, 4 * C); }, repeats), gemm * 4 * C, 0});
    rows.push_back({"matmul proj forward (4C to C)", time_gpu([&] { cuda::matmul_forward(p(y), p(wide), p(w_proj), p(b_proj), N, 4 * C, C); }, repeats), gemm * 4 * C, 0});
    rows.push_back({"matmul backward (4C to C)", time_gpu([&] { cuda::matmul_backward(p(wide), dw.as<float>(), db.as<float>(), p(y), p(wide), p(w_proj), N, 4 * C, C, GradMode::overwrite); }, repeats), 2 * gemm * 4 * C, 0});
    // QK^T and PV over the causal half of the square (i <= j): what a causal kernel must
    // compute; the backward is 2.5 times that (recomputed S, dV, dP, dQ, dK).
    const double attention = 4.0 * B * C * (T * (T + 1) / 2.0);
    // The default engine first (cuDNN's fused attention where it took the shape), then
    // the FlashAttention-2 kernel beside it where cuDNN did.
    // KVH key/value heads (the GPT's rows: KVH = H, qkv (N, 3C)); qkv and dqkv hold 3C.
    std::int64_t KVH = H;
    const auto engine = [&](bool backward) {
      return std::string(cuda::attention_on_cudnn(B, T, C, H, KVH, backward) ? " (cuDNN)" : " (FlashAttention-2 kernel)");
    };
    const auto attention_rows = [&](const std::string& forward_name, const std::string& backward_name) {
      const double forward = time_gpu([&] { cuda::attention_forward(p(y), lse.as<float>(), p(qkv), B, T, C, H, KVH); }, repeats);
      rows.push_back({forward_name + engine(false), forward, attention, 0});
      const double backward = time_gpu([&] { cuda::attention_backward(p(dqkv), p(x), p(qkv), p(y), lse.as<float>(), B, T, C, H, KVH); }, repeats);
      rows.push_back({backward_name + engine(true), backward, 2.5 * attention, 0});
    };
    const auto both_engines = [&](const std::string& forward_name, const std::string& backward_name) {
      attention_rows(forward_name, backward_name);
      if (cuda::attention_on_cudnn(B, T, C, H, KVH, false) || cuda::attention_on_cudnn(B, T, C, H, KVH, true)) {
        cuda::set_attention_engine(cuda::AttentionEngine::kernel);
        attention_rows("kernel " + forward_name, "kernel " + backward_name);
        cuda::set_attention_engine(cuda::AttentionEngine::automatic);
      }
    };
    both_engines("attention forward", "attention backward");
    rows.push_back({"layernorm forward", time_gpu([&] { cuda::layernorm_forward(p(y), mean.as<float>(), rstd.as<float>(), p(x), p(ln_w), p(ln_b), N, C); }, repeats), 0, 2.0 * N * C * 2});
    rows.push_back({"layernorm backward", time_gpu([&] { cuda::layernorm_backward(p(y), dln.as<float>(), dln.as<float>() + C, p(x), p(x), p(ln_w), mean.as<float>(), rstd.as<float>(), N, C, GradMode::overwrite); }, repeats), 0, 3.0 * N * C * 2});
    rows.push_back({"gelu backward (4C)", time_gpu([&] { cuda::gelu_backward(p(wide), p(wide), p(pre), N * 4 * C, GradMode::overwrite); }, repeats), 0, 3.0 * N * 4 * C * 2});
    rows.push_back({"add (residual)", time_gpu([&] { cuda::add(p(y), p(x), N * C); }, repeats), 0, 3.0 * N * C * 2});

    // A Llama block's own ops at the same size: grouped-query attention (qkv of C + 2 KV
    // fits the GPT's 3C buffers), RMSNorm, RoPE over the queries and keys, SwiGLU of F = 2C
    // (its (N, 2F) input in `wide`).
    if (kv_heads > 0 && H % kv_heads == 0 && kv_heads != H) {
      KVH = kv_heads;
      both_engines("GQA attention fwd (KVH " + std::to_string(KVH) + ")", "GQA attention bwd");
    }
    KVH = H;
    const std::int64_t F = 2 * C, KV = kv_heads > 0 ? C / H * kv_heads : C;
    rows.push_back({"rmsnorm forward", time_gpu([&] { cuda::rmsnorm_forward(p(y), rstd.as<float>(), p(x), p(ln_w), N, C, 1e-5f); }, repeats), 0, 2.0 * N * C * 2});
    rows.push_back({"rmsnorm backward", time_gpu([&] { cuda::rmsnorm_backward(p(y), dln.as<float>(), p(x), p(x), p(ln_w), rstd.as<float>(), N, C, GradMode::overwrite); }, repeats), 0, 3.0 * N * C * 2});
    if (kv_heads > 0 && H % kv_heads == 0 && (C / H) % 2 == 0)
      rows.push_back({"rope (queries and keys, in place)", time_gpu([&] { cuda::rope_apply(p(qkv), B, T, C, H, kv_heads, 0, 10000.0f, false); }, repeats), 0, 2.0 * N * (C + KV) * 2});
    rows.push_back({"swiglu forward (F 2C)", time_gpu([&] { cuda::swiglu_forward(p(pre), p(wide), N, F); }, repeats), 0, 3.0 * N * F * 2});
    rows.push_back({"swiglu backward (over its input)", time_gpu([&] { cuda::swiglu_backward(p(wide), p(pre), p(wide), N, F, GradMode::overwrite); }, repeats), 0, 5.0 * N * F * 2});
  }
  {
    cuda::DeviceBuffer logits = bf16_buffer(N * V), lse(static_cast<std::size_t>(N) * 4), loss(8),
        targets(static_cast<std::size_t>(N) * 4);
    cuda::zero(targets.data(), targets.bytes());
    rows.push_back({"cross-entropy forward (V " + std::to_string(V) + ")", time_gpu([&] { cuda::crossentropy_forward(lse.as<float>(), loss.as<double>(), logits.as<bf16>(), targets.as<int32_t>(), N, V); }, repeats), 0, 1.0 * N * V * 2});
    rows.push_back({"cross-entropy backward", time_gpu([&] { cuda::crossentropy_backward(logits.as<bf16>(), logits.as<bf16>(), lse.as<float>(), targets.as<int32_t>(), 1.0f, N, V); }, repeats), 0, 2.0 * N * V * 2});
  }
  {
    // Convolution and BatchNorm at ResNet-50's shapes (the second stage's 3x3 and a
    // bottleneck's 1x1 expansion at 56 x 56, batch 32), bf16.
    const std::int64_t n = 32, side = 56;
    const auto conv_window = [&](std::int64_t in, std::int64_t out, std::int64_t kernel) {
      Window2d w;
      w.N = n, w.C = in, w.H = w.W = side, w.OC = out, w.KH = w.KW = kernel, w.padding = kernel / 2;
      w.OH = w.OW = side;
      return w;
    };
    cuda::DeviceBuffer x = bf16_buffer(n * 256 * side * side), y = bf16_buffer(n * 256 * side * side),
                       dx = bf16_buffer(n * 256 * side * side), weight = bf16_buffer(256 * 64 * 9),
                       bn_w = bf16_buffer(256), bn_b = bf16_buffer(256);
    cuda::DeviceBuffer dweight(static_cast<std::size_t>(256 * 64 * 9) * 4), stats(static_cast<std::size_t>(4 * 256) * 4);
    auto p = [](cuda::DeviceBuffer& d) { return d.as<bf16>(); };
    for (const auto& [name, w] : {std::pair{std::string("conv2d 3x3 64 to 64"), conv_window(64, 64, 3)},
                                  std::pair{std::string("conv2d 1x1 64 to 256"), conv_window(64, 256, 1)}}) {
      const double flops = 2.0 * w.N * w.OC * w.OH * w.OW * w.C * w.KH * w.KW;
      rows.push_back({name + " forward (56 x 56, N 32)", time_gpu([&] { cuda::conv2d_forward(p(y), p(x), p(weight), (const bf16*)nullptr, w); }, repeats), flops, 0});
      rows.push_back({name + " backward", time_gpu([&] { cuda::conv2d_backward(p(dx), dweight.as<float>(), (float*)nullptr, p(y), p(x), p(weight), w, GradMode::overwrite); }, repeats), 2 * flops, 0});
    }
    const std::int64_t ch = 256, plane = side * side;
    float* f = stats.as<float>();
    rows.push_back({"batchnorm forward (256 ch, 56 x 56, N 32)", time_gpu([&] { cuda::batchnorm_forward_train(p(y), f, f + ch, f + 2 * ch, f + 3 * ch, (double*)nullptr, p(x), p(bn_w), p(bn_b), n, ch, plane, 1e-5f, 0.1f); }, repeats), 0, 3.0 * n * ch * plane * 2});
    rows.push_back({"batchnorm backward", time_gpu([&] { cuda::batchnorm_backward(p(dx), f + 2 * ch, f + 3 * ch, p(y), p(x), p(bn_w), f, f + ch, n, ch, plane, GradMode::overwrite); }, repeats), 0, 5.0 * n * ch * plane * 2});
  }
  std::printf("| op (B %lld, T %lld, C %lld, H %lld, bf16) | ms | TFLOP/s | of GEMM rate | GB/s |\n|---|---|---|---|---|\n",
              static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(C), static_cast<long long>(H));
  for (const Row& r : rows) {
    if (r.flops > 0)
      std::printf("| %s | %.3f | %.1f | %.1f%% | |\n", r.what.c_str(), 1e3 * r.seconds, r.flops / r.seconds / 1e12,
                  100.0 * r.flops / r.seconds / peak);
    else
      std::printf("| %s | %.3f | | | %.0f |\n", r.what.c_str(), 1e3 * r.seconds, r.bytes / r.seconds / 1e9);
  }

  // The whole step: a GPT-2-medium-sized model on this GPU, K = 1, bf16, AdamW.
  TrainConfig config;
  config.model.kind = "gpt";
  config.model.layers = layers;
  config.model.d_model = channels;
  config.model.heads = heads;
  config.model.seq_len = seq;
  config.model.vocab = vocab;
  config.batch_size = batch * micro_batches;
  config.micro_batches = micro_batches;
  config.steps = steps + 2;
  config.device = "cuda";
  config.precision = "bf16";
  config.pipeline.remat = "never";
  const Communicator self = Communicator::borrow(MPI_COMM_SELF);
  Executor exec(plan_run(config, self), self);
  exec.connect();
  exec.allocate();
  // Model FLOPs: forward plus backward of every layer, no recomputation counted.
  double flops = 0;
  const std::vector<Shape> shapes = exec.model().shapes(batch);
  for (int i = 0; i < exec.model().size(); ++i) {
    const Cost c = exec.model().layer(i).cost(shapes[i]);
    flops += (c.forward_flops + c.backward_flops) * micro_batches;
  }
  std::vector<double> seconds;
  for (int s = 0; s < config.steps; ++s) {
    const StepResult r = exec.step(s);
    if (s >= 2) seconds.push_back(r.seconds);
  }
  std::sort(seconds.begin(), seconds.end());
  const double step = seconds[seconds.size() / 2];
  const double tokens = static_cast<double>(config.batch_size) * seq;
  std::printf("\n| whole step (%d blocks, d %d, %lld parameters, %d x %d samples, bf16) | value |\n|---|---|\n", layers,
              channels, static_cast<long long>(exec.model().parameter_count()), micro_batches, batch);
  std::printf("| median step | %.1f ms |\n| tokens/s | %.0f |\n| model TFLOP/s | %.1f |\n| MFU (of measured GEMM rate) | %.1f%% |\n",
              1e3 * step, tokens / step, flops / step / 1e12, 100.0 * flops / step / peak);
  std::printf("| peak activation memory | %.2f GiB |\n", static_cast<double>(exec.peak_activation_bytes()) / (1 << 30));
  MPI_Finalize();
  return 0;
}
