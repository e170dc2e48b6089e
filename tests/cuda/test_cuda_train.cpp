// The executor on the GPU: a whole training step against the same step on the CPU, and
// partition transparency on one GPU (K = 1 against K = 2, two ranks sharing it), for the
// GPT and for a CNN with every convolutional layer kind. Run under mpiexec -n 2; every
// rank binds GPU (local rank modulo GPUs) in cuda_main.cpp.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "unet_model.hpp"
#include "tiny_gpt.hpp"
#include "compare.hpp"
#include "gather.hpp"
#include "mpipe/app/config.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/pipeline/run/executor.hpp"
#include "temp_dir.hpp"

using namespace mpipe;
using mpipe::test::gather_params;
using mpipe::test::relative_difference;
using mpipe::test::world;

namespace {

TrainConfig small_gpt(const std::string& device, const std::string& precision) {
  // 6 layers: embedding, 2 blocks, layernorm, head, loss
  TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 64, .heads = 4, .seq_len = 32, .vocab = 96, .dropout = 0.1f,
                                  .batch_size = 8, .micro_batches = 2, .steps = 4, .seed = 5, .lr = 3e-3f,
                                  .weight_decay = 0.1f});
  c.threads = 2;
  c.device = device;
  c.precision = precision;
  c.pipeline.partition = "uniform";
  return c;
}

// Runs `config` on the first `ranks` world ranks (the others sit it out).
struct Run {
  std::vector<double> losses, norms;
  std::vector<float> grads;   // this rank's gradients after compute_gradients(0), host copy
  std::vector<float> params;  // every parameter in global layer order, on rank 0 of the run
  std::int64_t rolled_back = 0;  // --overlap-steps: updates made ahead and undone
};

std::vector<float> host_grads(Executor& e) {
  const std::span<float> g = e.params().grads();
  std::vector<float> out(g.size());
  if (e.device() == Device::cpu) {
    std::memcpy(out.data(), g.data(), g.size_bytes());
  } else {
    cuda::copy_to_host(out.data(), g.data(), g.size_bytes());
    cuda::synchronize(cuda::StreamKind::compute);
  }
  return out;
}

// Whether run() first computes one step's gradients alone (for Run::grads, on one rank).
// That pass is a training forward too: under BatchNorm's `micro` rule it moves the running
// statistics, so a run compared bit for bit with one of more ranks must not make it.
enum class Grads { take, skip };

Run run(const TrainConfig& config, int ranks, int steps, Grads grads = Grads::take) {
  Run result;
  const Communicator sub = Communicator::split(world(), world().rank() < ranks ? 0 : MPI_UNDEFINED, world().rank());
  if (sub.null()) return result;
  Executor exec(plan_run(config, sub), sub);
  exec.connect();
  exec.allocate();
  if (ranks == 1 && grads == Grads::take) {
    exec.compute_gradients(0);
    result.grads = host_grads(exec);
  }
  auto take = [&](const StepResult& r) {
    result.losses.push_back(r.loss);
    result.norms.push_back(r.grad_norm);
  };
  for (int s = 0; s < steps; ++s) {
    if (!config.pipeline.overlap_steps) {
      take(exec.step(s));
      continue;
    }
    for (const StepResult& r : exec.advance(s)) take(r);  // earlier steps', validated
  }
  if (const std::optional<StepResult> r = exec.settle()) take(*r);
  result.rolled_back = exec.rolled_back();
  result.params = gather_params(exec, sub);
  return result;
}

double relative(double a, double b) { return std::abs(a - b) / std::abs(b); }

// How close a GPU run must come to the CPU's: gradients (after compute_gradients and the
// steps' norms), losses, and the parameters after the steps.
struct Tolerance {
  double grads, losses, params;
};
Tolerance tolerance_for(const std::string& precision, double fp32_grads, double bf16_grads) {
  // fp32 differs from the CPU only in summation order; bf16 rounds every activation.
  return precision == "fp32" ? Tolerance{fp32_grads, 1e-5, 1e-4} : Tolerance{bf16_grads, 1e-2, bf16_grads};
}

void check_close(const Run& gpu, const Run& cpu, const Tolerance& t) {
  REQUIRE(gpu.grads.size() == cpu.grads.size());
  CHECK(relative_difference(gpu.grads, cpu.grads) < t.grads);
  REQUIRE(gpu.losses.size() == cpu.losses.size());
  for (std::size_t s = 0; s < cpu.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(relative(gpu.losses[s], cpu.losses[s]) < t.losses);
    CHECK(relative(gpu.norms[s], cpu.norms[s]) < t.grads);
  }
  // A few AdamW steps on gradients this close move the weights (and BatchNorm's running
  // statistics) alike.
  CHECK(relative_difference(gpu.params, cpu.params) < t.params);
}

// Losses, norms and parameters, bit for bit.
void check_same_bits(const Run& a, const Run& b) {
  CHECK(a.losses == b.losses);
  CHECK(a.norms == b.norms);
  REQUIRE(a.params.size() == b.params.size());
  CHECK(std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)) == 0);
}

// A CNN with every convolutional kind: a strided, padded stem with BatchNorm, a padded
// max pool, a grouped convolution, a residual block with a projection and skip-norm, an
// average pool, global average pooling and flatten, then the head. Written once per rank.
std::string cnn_model_file() {
  const auto path = mpipe::testing::test_file("cuda_cnn.toml");
  std::ofstream(path) << "input = [3, 20, 20]\n"
                         "[[layer]]\nkind = \"conv2d\"\nout = 8\nkernel = 5\nstride = 2\npadding = 2\nbias = false\n"
                         "[[layer]]\nkind = \"batchnorm2d\"\n"
                         "[[layer]]\nkind = \"relu\"\n"
                         "[[layer]]\nkind = \"maxpool2d\"\nkernel = 3\nstride = 1\npadding = 1\n"
                         "[[layer]]\nkind = \"conv2d\"\nout = 12\nkernel = 3\npadding = 1\ngroups = 4\n"
                         "[[layer]]\nkind = \"relu\"\n"
                         "[[layer]]\nkind = \"residual\"\nskip-norm = true\n"
                         "[[layer.layer]]\nkind = \"conv2d\"\nout = 16\nkernel = 3\nstride = 2\npadding = 1\nbias = false\n"
                         "[[layer.layer]]\nkind = \"batchnorm2d\"\nmomentum = 0.2\n"
                         "[[layer.layer]]\nkind = \"relu\"\n"
                         "[[layer.layer]]\nkind = \"conv2d\"\nout = 16\nkernel = 1\n"
                         "[[layer]]\nkind = \"avgpool2d\"\nkernel = 2\n"
                         "[[layer]]\nkind = \"conv2d\"\nout = 10\nkernel = 1\n"
                         "[[layer]]\nkind = \"global-avgpool\"\n"
                         "[[layer]]\nkind = \"flatten\"\n"
                         "[[layer]]\nkind = \"linear\"\nout = 5\n"
                         "[[layer]]\nkind = \"cross_entropy\"\n";
  return path.string();
}

// A model file's run the GPU cases share: batch 16, 3 steps, 2 threads, lr 3e-3.
TrainConfig small_file_run(const std::string& model_file, const std::string& device, const std::string& precision,
                           int micro_batches, std::uint64_t seed) {
  TrainConfig c;
  c.model.kind = model_file;
  c.batch_size = 16;
  c.micro_batches = micro_batches;
  c.steps = 3;
  c.seed = seed;
  c.threads = 2;
  c.optimizer.lr = 3e-3f;
  c.device = device;
  c.precision = precision;
  return c;
}

TrainConfig small_cnn(const std::string& device, const std::string& precision, const std::string& batchnorm) {
  TrainConfig c = small_file_run(cnn_model_file(), device, precision, 2, 9);
  c.pipeline.batchnorm = batchnorm;
  c.pipeline.partition = "uniform";
  return c;
}

}  // namespace

TEST_CASE("training step on the GPU matches the CPU: fp32 and bf16") {
  // K = 1 on rank 0, the CPU executor the reference. Every rank calls run() (its
  // communicator split is collective), the others sitting each run out.
  cpu::set_threads(2);
  const Run reference = run(small_gpt("cpu", "fp32"), 1, 3);
  for (const std::string precision : {"fp32", "bf16"}) {
    CAPTURE(precision);
    const Run gpu = run(small_gpt("cuda", precision), 1, 3);
    TrainConfig remat = small_gpt("cuda", precision);
    remat.pipeline.remat = "always";
    const Run recomputed = run(remat, 1, 3);
    remat.pipeline.remat = "selective";
    const Run selective = run(remat, 1, 3);
    if (world().rank() != 0) continue;
    check_close(gpu, reference, tolerance_for(precision, 1e-5, 2e-2));
    CHECK(gpu.losses.back() < gpu.losses.front());
    // Recomputation gives the same bits, and counts each micro-batch's loss once.
    CHECK(recomputed.losses == gpu.losses);
    CHECK(recomputed.params == gpu.params);
    // Selective: the same bits in fp32; in bf16 its GELU runs apart from the fc GEMM (as
    // its recomputation does), where never's is cuBLASLt's epilogue, rounded its own way.
    if (precision == "fp32") {
      CHECK(selective.losses == gpu.losses);
      CHECK(selective.params == gpu.params);
    } else {
      check_close(selective, gpu, tolerance_for(precision, 1e-5, 2e-2));
    }
  }
}

TEST_CASE("partition transparency on one GPU: K = 2 gives K = 1's bits, fp32 and bf16") {
  REQUIRE(world().size() >= 2);
  for (const std::string precision : {"fp32", "bf16"}) {
    for (const std::string schedule : {"gpipe", "1f1b", "1f1b/selective"}) {
      CAPTURE(precision);
      CAPTURE(schedule);
      TrainConfig config = small_gpt("cuda", precision);
      config.pipeline.schedule = schedule.substr(0, schedule.find('/'));
      config.pipeline.remat = schedule.find('/') != std::string::npos ? "selective" : "except-last";
      const Run one = run(config, 1, 3, Grads::skip);
      config.pipeline.grid.stages = 2;
      const Run two = run(config, 2, 3);
      if (world().rank() != 0) continue;
      check_same_bits(one, two);
    }
  }
}

TEST_CASE("overlap-steps transparency on one GPU: updates made ahead give the synchronized bits, fp32 and bf16") {
  // zb-h2 on two ranks sharing the GPU; clip 0 wins every bet, 1e-3 loses every one (the
  // values, gradients, Adam state and bf16 copy go back on the device and the update is
  // redone clipped).
  REQUIRE(world().size() >= 2);
  for (const std::string precision : {"fp32", "bf16"}) {
    for (const float clip : {0.0f, 1e-3f}) {
      CAPTURE(precision);
      CAPTURE(clip);
      TrainConfig config = small_gpt("cuda", precision);
      config.pipeline.schedule = "zb-h2";
      config.pipeline.grid.stages = 2;
      config.micro_batches = 4;
      config.optimizer.clip_grad = clip;
      const Run synchronized = run(config, 2, 5);
      config.pipeline.overlap_steps = true;
      const Run overlapped = run(config, 2, 5);
      if (world().rank() != 0) continue;
      check_same_bits(overlapped, synchronized);
      CHECK((clip > 0 ? overlapped.rolled_back >= 1 : overlapped.rolled_back == 0));
    }
  }
}

TEST_CASE("sharding transparency on one GPU: --shard-optimizer over two replicas gives the unsharded bits, fp32 and bf16") {
  // D = 2 on two ranks sharing the GPU: each updates its rows of every view on the device
  // (the packed state's offsets in the update's view table), then the rows travel (from
  // device memory with a CUDA-aware MPI, else through the host mirror) and the bf16
  // compute copy is refreshed. AdamW and SGD, a GPT and a CNN with BatchNorm.
  REQUIRE(world().size() >= 2);
  for (const std::string precision : {"fp32", "bf16"}) {
    for (const std::string what : {"gpt/adamw", "gpt/sgd", "cnn/micro", "cnn/deferred"}) {
      CAPTURE(precision);
      CAPTURE(what);
      TrainConfig config = what.starts_with("gpt") ? small_gpt("cuda", precision)
                                                   : small_cnn("cuda", precision, what.substr(4));
      if (what == "gpt/sgd") config.optimizer.kind = "sgd";
      config.pipeline.grid.replicas = 2;
      config.micro_batches = 1;
      const Run plain = run(config, 2, 3);
      config.pipeline.shard_optimizer = true;
      const Run sharded = run(config, 2, 3);
      if (world().rank() != 0) continue;
      check_same_bits(sharded, plain);
    }
  }
}

TEST_CASE("training step on the GPU matches the CPU with the LM head in vocabulary chunks, and K = 2 its bits") {
  // --head-chunks 3: three vocab-chunk layers carrying the online softmax, then the loss.
  cpu::set_threads(2);
  for (const std::string precision : {"fp32", "bf16"}) {
    CAPTURE(precision);
    TrainConfig chunked = small_gpt("cuda", precision);
    chunked.model.head_chunks = 3;
    chunked.model.head_logits = precision == "fp32" ? "keep" : "recompute";  // both ways of the backward
    TrainConfig on_cpu = chunked;
    on_cpu.device = "cpu";
    on_cpu.precision = "fp32";
    const Run reference = run(on_cpu, 1, 3);
    const Run gpu = run(chunked, 1, 3);
    // The head's chunks split over two stages: chunk 0 with the blocks, chunks 1 and 2
    // with the loss.
    chunked.pipeline.grid.stages = 2;
    chunked.pipeline.balance = "5,3";
    const Run two = run(chunked, 2, 3);
    if (world().rank() != 0) continue;
    check_close(gpu, reference, tolerance_for(precision, 1e-5, 2e-2));
    check_same_bits(two, gpu);
  }
}

TEST_CASE("training step on the GPU matches the CPU for a CNN with BatchNorm under both rules: fp32 and bf16") {
  cpu::set_threads(2);
  for (const std::string rule : {"micro", "deferred"}) {
    const Run reference = run(small_cnn("cpu", "fp32", rule), 1, 3);
    for (const std::string precision : {"fp32", "bf16"}) {
      CAPTURE(rule);
      CAPTURE(precision);
      const Run gpu = run(small_cnn("cuda", precision, rule), 1, 3);
      TrainConfig remat = small_cnn("cuda", precision, rule);
      remat.pipeline.remat = "always";
      const Run recomputed = run(remat, 1, 3);
      remat.pipeline.remat = "selective";  // the residual block's inner BatchNorm and ReLU recomputed
      const Run selective = run(remat, 1, 3);
      if (world().rank() != 0) continue;
      // fp32: the GPU sums a convolution's samples in one GEMM (or cuDNN), the CPU one by one.
      check_close(gpu, reference, tolerance_for(precision, 1e-4, 3e-2));
      // Recomputation moves no running statistic: the same bits.
      CHECK(recomputed.losses == gpu.losses);
      CHECK(recomputed.params == gpu.params);
      CHECK(selective.losses == gpu.losses);
      CHECK(selective.params == gpu.params);
    }
  }
}

TEST_CASE("partition transparency on one GPU for a CNN with BatchNorm: K = 2 gives K = 1's bits") {
  REQUIRE(world().size() >= 2);
  for (const std::string precision : {"fp32", "bf16"}) {
    for (const std::string rule : {"micro", "deferred"}) {
      for (const std::string schedule : {"1f1b", "zb-h1"}) {
        CAPTURE(precision);
        CAPTURE(rule);
        CAPTURE(schedule);
        TrainConfig config = small_cnn("cuda", precision, rule);
        config.pipeline.schedule = schedule;
        const Run one = run(config, 1, 3, Grads::skip);
        config.pipeline.grid.stages = 2;
        const Run two = run(config, 2, 3);
        if (world().rank() != 0) continue;
        check_same_bits(one, two);
      }
    }
  }
}

namespace {
// tests/reference/unet.toml (tests/unet_model.hpp): nested concat skips, an add skip, upsampling, a label per pixel.
std::string unet_model_file() {
  const auto path = mpipe::testing::test_file("cuda_unet.toml");
  std::ofstream(path) << mpipe::test::unet_text;
  return path.string();
}

TrainConfig small_unet(const std::string& device, const std::string& precision) {
  return small_file_run(unet_model_file(), device, precision, 4, 3);
}
}  // namespace

TEST_CASE("the U-Net on the GPU matches the CPU, and K = 2 with its skips across the cut gives K = 1's bits: fp32 and bf16") {
  REQUIRE(world().size() >= 2);
  cpu::set_threads(2);
  const Run reference = run(small_unet("cpu", "fp32"), 1, 3);
  for (const std::string precision : {"fp32", "bf16"}) {
    CAPTURE(precision);
    const Run one = run(small_unet("cuda", precision), 1, 3);
    TrainConfig split = small_unet("cuda", precision);
    split.pipeline.grid.stages = 2;
    split.pipeline.balance = "9,10";  // every skip crosses the cut (top 0 -> 16, level1 2 -> 14, level2 5 -> 11)
    const Run two = run(split, 2, 3);
    if (world().rank() != 0) continue;
    check_close(one, reference, tolerance_for(precision, 1e-4, 3e-2));
    check_same_bits(one, two);
  }
}

TEST_CASE("training with --channels-last on: a CNN with BatchNorm and the U-Net on the GPU match the CPU, and K = 2 gives K = 1's bits: fp32 and bf16") {
  REQUIRE(world().size() >= 2);
  cpu::set_threads(2);
  const std::pair<const char*, TrainConfig> models[] = {{"cnn", small_cnn("cpu", "fp32", "deferred")},
                                                        {"unet", small_unet("cpu", "fp32")}};
  for (const auto& [name, base] : models) {
    const Run reference = run(base, 1, 3);  // channels first, on the CPU
    for (const std::string precision : {"fp32", "bf16"}) {
      CAPTURE(name);
      CAPTURE(precision);
      TrainConfig config = base;
      config.device = "cuda";
      config.precision = precision;
      config.channels_last = "on";
      const Run one = run(config, 1, 3);
      const Run one_skip = run(config, 1, 3, Grads::skip);
      config.pipeline.grid.stages = 2;
      const Run two = run(config, 2, 3);
      if (world().rank() != 0) continue;
      check_close(one, reference, tolerance_for(precision, 1e-4, 3e-2));
      check_same_bits(one_skip, two);
    }
  }
}

TEST_CASE("CUDA graphs give the bits of kernels launched one by one: GPT with dropout, remat, zb-h1, CNN, U-Net") {
  // --cuda-graphs on records each action from the third step and updates the graph in
  // place after: five steps make three graphed ones, the dropout's masks new in each.
  REQUIRE(world().size() >= 2);
  struct Case {
    std::string name;
    TrainConfig config;
    int ranks;
  };
  std::vector<Case> cases;
  for (const std::string precision : {"fp32", "bf16"}) {
    TrainConfig gpt = small_gpt("cuda", precision);
    gpt.micro_batches = 4;
    cases.push_back({"gpt/gpipe/" + precision, gpt, 1});
    gpt.pipeline.grid.stages = 2;
    gpt.pipeline.schedule = "1f1b";
    gpt.pipeline.remat = "always";
    cases.push_back({"gpt/1f1b/always/" + precision, gpt, 2});
    gpt.pipeline.remat = "never";
    gpt.pipeline.schedule = "zb-h1";
    cases.push_back({"gpt/zb-h1/" + precision, gpt, 2});
    TrainConfig cnn = small_cnn("cuda", precision, "deferred");
    cnn.micro_batches = 4;
    cases.push_back({"cnn/deferred/" + precision, cnn, 1});
  }
  TrainConfig unet = small_unet("cuda", "bf16");
  unet.pipeline.grid.stages = 2;
  unet.pipeline.balance = "9,10";
  cases.push_back({"unet/K2/bf16", unet, 2});
  for (Case& c : cases) {
    CAPTURE(c.name);
    // Graphed first: the process's first run of these shapes (ctest's cuda.graphs runs
    // this case alone) starts cold, as a user's does, and its first two steps must size
    // every scratch and make every library choice before recording begins.
    c.config.cuda_graphs = "on";
    const cuda::GraphCounts before = cuda::graph_counts();
    const Run graphed = run(c.config, c.ranks, 5, Grads::skip);
    const cuda::GraphCounts after = cuda::graph_counts();
    c.config.cuda_graphs = "off";
    const Run plain = run(c.config, c.ranks, 5, Grads::skip);
    CHECK(cuda::graph_counts().launched == after.launched);  // off launches none
    if (world().rank() != 0) continue;
    check_same_bits(graphed, plain);
    const std::int64_t launched = after.launched - before.launched, made = after.made - before.made,
                       updated = after.updated - before.updated, nodes = after.nodes - before.nodes;
    CAPTURE(launched);
    CAPTURE(made);
    CAPTURE(updated);
    CAPTURE(nodes);
    // Steps 3-5 graph every action but the step's last backward or W (its hooks start the
    // sums): step 3 makes each graph, steps 4 and 5 update it in place. The kernels are in
    // the graphs (were they queued elsewhere, they would run at once and leave them empty).
    CHECK(launched > 0);
    CHECK(made * 3 == launched);
    CHECK(updated * 3 == 2 * launched);
    CHECK(nodes >= 2 * launched);
  }
}

TEST_CASE("training on the GPU holds the plan's activation memory within 15%, fp32 and bf16 (activations in the run's precision)") {
  // One rank, GPipe over 4 micro-batches of a GPT: the arenas' peak against
  // plan.activation_bytes(0), which counts bf16 activations at 2 bytes (LayerNorm's
  // statistics and the attention's log-sum-exp at 4). Before, the plan counted 4 for every
  // element: about 2x the peak in bf16. (The CNN's plan counts the CPU's im2col columns,
  // which cuDNN does not take: not compared here.)
  for (const std::string precision : {"fp32", "bf16"}) {
    CAPTURE(precision);
    TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 256, .heads = 4, .seq_len = 128, .vocab = 512, .dropout = 0.1f,
                                    .batch_size = 8, .micro_batches = 4, .steps = 2, .seed = 5});
    c.device = "cuda";
    c.precision = precision;
    c.threads = 2;
    const Communicator sub = Communicator::split(world(), world().rank() == 0 ? 0 : MPI_UNDEFINED, world().rank());
    if (sub.null()) continue;
    const Plan plan = plan_run(c, sub);
    Executor exec(plan, sub);
    exec.connect();
    exec.allocate();
    for (int step = 0; step < 2; ++step) exec.step(step);
    const double measured = static_cast<double>(exec.peak_activation_bytes()), predicted = plan.activation_bytes(0);
    CAPTURE(measured);
    CAPTURE(predicted);
    CHECK(std::abs(predicted / measured - 1) <= 0.15);
  }
}
