// The executor on the GPU: a whole training step against the same step on the CPU, and
// partition transparency on one GPU (K = 1 against K = 2, two ranks sharing it). Run
// under mpiexec -n 2; every rank binds GPU (local rank modulo GPUs) in cuda_main.cpp.
#include <doctest/doctest.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "tiny_gpt.hpp"
#include "compare.hpp"
#include "gather.hpp"
#include "mpipe/app/config.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/pipeline/executor.hpp"

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

Run run(const TrainConfig& config, int ranks, int steps) {
  Run result;
  const Communicator sub = Communicator::split(world(), world().rank() < ranks ? 0 : MPI_UNDEFINED, world().rank());
  if (sub.null()) return result;
  Executor exec(plan_run(config, sub), sub);
  exec.connect();
  exec.allocate();
  if (ranks == 1) {
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

}  // namespace

TEST_CASE("training step on the GPU matches the CPU: fp32 and bf16") {
  // One process, K = 1: the CPU executor is the reference.
  if (world().rank() != 0) return;
  cpu::set_threads(2);
  const Run reference = run(small_gpt("cpu", "fp32"), 1, 3);
  for (const std::string precision : {"fp32", "bf16"}) {
    CAPTURE(precision);
    const Run gpu = run(small_gpt("cuda", precision), 1, 3);
    // fp32 differs from the CPU only in summation order; bf16 rounds every activation.
    const double tolerance = precision == "fp32" ? 1e-5 : 2e-2;
    REQUIRE(gpu.grads.size() == reference.grads.size());
    CHECK(relative_difference(gpu.grads, reference.grads) < tolerance);
    for (std::size_t s = 0; s < reference.losses.size(); ++s) {
      CAPTURE(s);
      CHECK(relative(gpu.losses[s], reference.losses[s]) < (precision == "fp32" ? 1e-5 : 1e-2));
      CHECK(relative(gpu.norms[s], reference.norms[s]) < tolerance);
    }
    // Three AdamW steps on gradients this close move the weights alike.
    CHECK(relative_difference(gpu.params, reference.params) < (precision == "fp32" ? 1e-4 : 2e-2));
    CHECK(gpu.losses.back() < gpu.losses.front());
    // Recomputation gives the same bits, and counts each micro-batch's loss once.
    TrainConfig remat = small_gpt("cuda", precision);
    remat.pipeline.remat = "always";
    const Run recomputed = run(remat, 1, 3);
    CHECK(recomputed.losses == gpu.losses);
    CHECK(recomputed.params == gpu.params);
  }
}

TEST_CASE("partition transparency on one GPU: K = 2 gives K = 1's bits, fp32 and bf16") {
  REQUIRE(world().size() >= 2);
  for (const std::string precision : {"fp32", "bf16"}) {
    for (const std::string schedule : {"gpipe", "1f1b"}) {
      CAPTURE(precision);
      CAPTURE(schedule);
      TrainConfig config = small_gpt("cuda", precision);
      config.pipeline.schedule = schedule;
      config.pipeline.remat = "except-last";
      const Run one = run(config, 1, 3);
      config.pipeline.grid.stages = 2;
      const Run two = run(config, 2, 3);
      if (world().rank() != 0) continue;
      REQUIRE(one.losses.size() == two.losses.size());
      for (std::size_t s = 0; s < one.losses.size(); ++s) {
        CAPTURE(s);
        CHECK(one.losses[s] == two.losses[s]);
        CHECK(one.norms[s] == two.norms[s]);
      }
      REQUIRE(one.params.size() == two.params.size());
      CHECK(std::memcmp(one.params.data(), two.params.data(), one.params.size() * sizeof(float)) == 0);
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
      CHECK(overlapped.losses == synchronized.losses);
      CHECK(overlapped.norms == synchronized.norms);
      REQUIRE(overlapped.params.size() == synchronized.params.size());
      CHECK(std::memcmp(overlapped.params.data(), synchronized.params.data(), overlapped.params.size() * sizeof(float)) == 0);
      CHECK((clip > 0 ? overlapped.rolled_back >= 1 : overlapped.rolled_back == 0));
    }
  }
}
