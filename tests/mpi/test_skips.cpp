// Skips across stages (nn/skip_layers.hpp) under mpiexec -n 4: a U-Net whose stashed
// tensors cross one, two and three stage boundaries, or stay inside a stage, trains
// bitwise as on one rank under every schedule and re-materialization mode, and each skip
// moves its own bytes once, from its producer's rank straight to its consumer's.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gather.hpp"
#include "resnet18.hpp"
#include "mpipe/app/config.hpp"
#include "temp_dir.hpp"
#include "unet_model.hpp"

using namespace mpipe;
using mpipe::test::gather_params;
using mpipe::test::world;

namespace {

std::string unet_file() {
  static const std::string path = [] {
    const auto p = mpipe::testing::test_file("skips_unet.toml");
    std::ofstream(p) << mpipe::test::unet_text;
    return p.string();
  }();
  return path;
}

TrainConfig unet(const std::string& schedule, const std::string& remat, const std::string& balance) {
  TrainConfig c;
  c.model.kind = unet_file();
  c.batch_size = 16;
  c.micro_batches = 4;
  c.steps = 3;
  c.seed = 7;
  c.threads = 1;
  c.optimizer.lr = 1e-2f;
  c.pipeline.schedule = schedule;
  c.pipeline.remat = remat;
  c.pipeline.balance = balance;
  return c;
}

struct Result {
  std::vector<double> losses;
  std::vector<float> params, last_replica;  // the first replica's and the last one's
  std::vector<std::uint64_t> bytes, skip_bytes;  // per rank of the run (on rank 0)
};

Result run(const TrainConfig& config, int ranks) {
  const Communicator sub = Communicator::split(world(), world().rank() < ranks ? 0 : MPI_UNDEFINED, world().rank());
  Result result;
  if (sub.null()) return result;
  try {
    Executor e(plan_run(config, sub), sub);
    e.connect();
    e.allocate();
    for (int step = 0; step < config.steps; ++step) result.losses.push_back(e.step(step).loss);
    result.params = gather_params(e, sub, 0);
    result.last_replica = gather_params(e, sub, e.grid().replicas() - 1);
    result.bytes = sub.gather(e.transport().bytes_sent(), 0);
    result.skip_bytes = sub.gather(e.transport().skip_bytes_sent(), 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", world().rank(), e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return result;
}

// Per K, layers per stage that put a skip inside a stage and make others cross one, two
// and three boundaries: K = 2 "12,7": level2 (5 -> 11) inside stage 0, level1 and top
// across; K = 4 "2,10,1,6": level2 inside stage 1, level1 (stage 1 -> 3) across two
// boundaries past stage 2, top (0 -> 3) across three.
const char* balance_of(int K) { return K == 2 ? "12,7" : K == 4 ? "2,10,1,6" : ""; }

}  // namespace

TEST_CASE("skips across stages: K = 1, 2, 4, every schedule and remat mode train bitwise as one rank") {
  if (world().size() != 4) return;
  const Result reference = run(unet("gpipe", "never", ""), 1);
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1", "zb-h2"})
    for (const char* remat : {"never", "selective", "except-last", "always"})
      for (int K : {2, 4})
        for (const bool by_flops : {false, true}) {
          if (by_flops && std::strcmp(schedule, "gpipe") != 0) continue;  // the partition the FLOPs choose, once
          const Result r = run(unet(schedule, remat, by_flops ? "" : balance_of(K)), K);
          if (world().rank() != 0) continue;
          INFO("schedule " << schedule << ", remat " << remat << ", K " << K << (by_flops ? ", by FLOPs" : ", balanced"));
          CHECK(r.losses == reference.losses);
          REQUIRE(r.params.size() == reference.params.size());
          CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
        }
  // Two model stages a rank: interleaved (round robin) and zbv (a V, where a skip may go
  // from a rank's first model stage to its second: MPI's message to itself).
  for (const char* schedule : {"interleaved", "zbv"})
    for (const char* remat : {"never", "always"})
      for (int K : {1, 2}) {
        TrainConfig c = unet(schedule, remat, "");
        c.pipeline.virtual_stages = 2;
        const Result r = run(c, K);
        if (world().rank() != 0) continue;
        INFO("schedule " << schedule << ", remat " << remat << ", K " << K);
        CHECK(r.losses == reference.losses);
        CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
      }
  if (world().rank() == 0) CHECK(reference.losses.back() < reference.losses.front());  // it trained
}

TEST_CASE("a skip's bytes go once, from its producer's rank straight to its consumer's: none through the stages between") {
  if (world().size() != 4) return;
  const TrainConfig config = unet("gpipe", "never", balance_of(4));
  const Result r = run(config, 4);
  if (world().rank() != 0) return;
  // One micro-batch of 4 samples; what crosses each of K = 4's cuts, and each skip.
  const Model model(config.model);
  const std::vector<Shape> shapes = model.shapes(4);
  const auto bytes = [&](int layer_input) { return static_cast<std::uint64_t>(shapes[static_cast<std::size_t>(layer_input)].numel()) * 4; };
  const std::uint64_t M = 4, steps = config.steps;
  // Stages [0, 2), [2, 12), [12, 13), [13, 19): each rank sends its output on and its
  // input's gradient back, M of each a step.
  const int cuts[] = {2, 12, 13};
  for (int rank = 0; rank < 4; ++rank) {
    std::uint64_t chain = 0;
    if (rank < 3) chain += bytes(cuts[rank]);
    if (rank > 0) chain += bytes(cuts[rank - 1]);
    CHECK(r.bytes[static_cast<std::size_t>(rank)] == steps * M * chain);
  }
  // top (layer 0's output, 0 -> 3) and level1 (layer 2's, 1 -> 3) leave their producers
  // forward and their consumer backward; level2 stays inside stage 1; stage 2, which
  // both cross, sends none of them.
  const std::uint64_t top = bytes(1), level1 = bytes(3);
  CHECK(r.skip_bytes[0] == steps * M * top);
  CHECK(r.skip_bytes[1] == steps * M * level1);
  CHECK(r.skip_bytes[2] == 0);
  CHECK(r.skip_bytes[3] == steps * M * (top + level1));
}


TEST_CASE("skips with replicas: D = 2 x K = 2, both skips' messages in each replica, the replicas stay bitwise identical") {
  if (world().size() != 4) return;
  TrainConfig config = unet("1f1b", "never", balance_of(2));
  config.pipeline.grid.replicas = 2;
  config.pipeline.batchnorm = "deferred";  // the running statistics summed over replicas too
  const Result r = run(config, 4);
  if (world().rank() != 0) return;
  REQUIRE(!r.params.empty());
  REQUIRE(r.params.size() == r.last_replica.size());
  CHECK(std::memcmp(r.params.data(), r.last_replica.data(), r.params.size() * sizeof(float)) == 0);
  CHECK(r.losses.back() < r.losses.front());
  // Each replica's pipeline moves its own skips: ranks 0 and 1 (replica 0's stages, rank
  // order pipeline), 2 and 3 (replica 1's) each send theirs.
  for (const std::uint64_t bytes : r.skip_bytes) CHECK(bytes > 0);
}

namespace {
// A CNN with each image layer the U-Net and ResNet lack: both pools, a biased convolution
// and a flatten over planes of 2 x 2 (which must swap a channels-last image back).
const char* pools_cnn = R"(input = [3, 8, 8]
[[layer]]
kind = "conv2d"
out = 8
kernel = 3
padding = 1
[[layer]]
kind = "relu"
[[layer]]
kind = "maxpool2d"
kernel = 2
[[layer]]
kind = "conv2d"
out = 6
kernel = 3
padding = 1
[[layer]]
kind = "batchnorm2d"
[[layer]]
kind = "relu"
[[layer]]
kind = "avgpool2d"
kernel = 2
[[layer]]
kind = "flatten"
[[layer]]
kind = "linear"
out = 4
[[layer]]
kind = "cross_entropy"
)";
}  // namespace

TEST_CASE("--channels-last on: the U-Net, a ResNet under both BatchNorm rules and a CNN with pools and a flatten train bitwise as channels first, K = 1, 2, 4") {
  if (world().size() != 4) return;
  static const std::string cnn_path = [] {
    const auto p = mpipe::testing::test_file("channels_last_cnn.toml");
    std::ofstream(p) << pools_cnn;
    return p.string();
  }();
  TrainConfig resnet = mpipe::test::resnet18(4, 8, 8, 3);
  resnet.model.classes = 3;
  resnet.seed = 5;
  resnet.optimizer.lr = 1e-2f;
  TrainConfig cnn = resnet;
  cnn.model = ModelConfig{};
  cnn.model.kind = cnn_path;
  TrainConfig deferred = resnet;
  deferred.pipeline.batchnorm = "deferred";
  const std::pair<const char*, TrainConfig> models[] = {
      {"unet", unet("gpipe", "never", "")}, {"resnet", resnet}, {"resnet deferred", deferred}, {"cnn", cnn}};
  for (const auto& [name, base] : models) {
    const Result reference = run(base, 1);
    for (const char* schedule : {"gpipe", "zb-h1"})
      for (const char* remat : {"never", "selective", "always"})
        for (int K : {1, 2, 4}) {
          TrainConfig c = base;
          c.pipeline.schedule = schedule;
          c.pipeline.remat = remat;
          c.channels_last = "on";
          const Result r = run(c, K);
          if (world().rank() != 0) continue;
          INFO(name << ", schedule " << schedule << ", remat " << remat << ", K " << K);
          CHECK(r.losses == reference.losses);
          REQUIRE(r.params.size() == reference.params.size());
          CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
        }
    if (world().rank() == 0) CHECK(reference.losses.back() < reference.losses.front());
  }
}
