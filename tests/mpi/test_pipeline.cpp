// The executor under mpiexec -n 4: partition transparency (bitwise, every K, schedule
// and remat mode, dropout on), replicas that never drift, and D = 2 against D = 1.
// Runs of different shapes share the 4 ranks through sub-communicators.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <fstream>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <hdf5.h>
#include <unistd.h>

#include "tiny_gpt.hpp"
#include "compare.hpp"
#include "gather.hpp"
#include "mpipe/app/config.hpp"
#include "mpipe/app/export.hpp"
#include "mpipe/io/init_from.hpp"

#include "mpipe/io/checkpoint.hpp"
#include "mpipe/pipeline/run/executor.hpp"
#include "mpipe/pipeline/comm/group_sum.hpp"
#include "mpipe/pipeline/comm/pair_sum.hpp"
#include "mpipe/pipeline/comm/progress.hpp"
#include "mpipe/pipeline/comm/watchdog.hpp"
#include "resnet18.hpp"
#include "run_pipeline.hpp"
#include "temp_dir.hpp"

using namespace mpipe;
using mpipe::test::gather_params;
using mpipe::test::relative_difference;
using mpipe::test::resnet18;
using mpipe::test::world;
using mpipe::test::run;
using mpipe::test::RunResult;
using mpipe::test::peak_memory;
using mpipe::test::PeakMemory;

namespace {

TrainConfig tiny_gpt(const std::string& schedule, const std::string& remat, int micro_batches = 4) {
  // 7 layers: embedding, 3 blocks, layernorm, head, loss
  TrainConfig c = test::tiny_gpt({.layers = 3, .d_model = 16, .heads = 2, .seq_len = 8, .vocab = 32, .dropout = 0.1f,
                                  .batch_size = 8, .micro_batches = micro_batches, .steps = 4, .seed = 11, .lr = 1e-2f,
                                  .weight_decay = 0.1f});
  c.threads = 1;
  c.optimizer.clip_grad = 0.5f;  // exercised: the norm of this model is above it
  c.pipeline.schedule = schedule;
  c.pipeline.remat = remat;
  c.pipeline.partition = "uniform";  // with K = 4: the head on stage 2, the embedding on stage 0
  return c;
}

// A directory for checkpoints, named on rank 0 and known to every rank.
std::string temp_dir(const char* prefix) {
  std::string dir = std::string("/tmp/") + prefix + "-XXXXXX";
  if (world().rank() == 0) dir = mkdtemp(dir.data());
  world().broadcast(dir, 0);
  return dir;
}

// Trains `config` on every rank for `steps` steps and checkpoints it; the parameters
// (on rank 0).
std::vector<float> train_and_save(const TrainConfig& config, int steps) {
  Executor writer(plan_run(config, world()), world());
  writer.connect();
  writer.allocate();
  for (int step = 0; step < steps; ++step) writer.step(step);
  CheckpointDir owner(checkpoint_options(config));
  owner.begin(world());
  save_checkpoint(writer, owner, steps);
  return gather_params(writer, world(), 0);
}

// Every dataset of checkpoint `path` (parameters and optimizer state), each read against
// its checksum (of the whole, however many ranks wrote its pieces), in file order.
std::vector<std::vector<float>> checkpoint_datasets(const std::string& path, const Model& model,
                                                    const std::vector<std::string>& states) {
  std::vector<DatasetSpec> all = parameter_datasets(model, "/model");
  for (const std::string& state : states)
    for (const DatasetSpec& d : parameter_datasets(model, "/optimizer/" + state)) all.push_back(d);
  std::vector<std::vector<float>> out;
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  REQUIRE(file >= 0);
  for (const DatasetSpec& d : all) {
    std::vector<float> values(static_cast<std::size_t>(d.shape.numel()));
    const auto problem = read_checked(file, d.path, d.shape, values.data());
    CHECK_MESSAGE(!problem, d.path, ": ", problem.value_or(""));
    out.push_back(std::move(values));
  }
  H5Fclose(file);
  return out;
}

// A model file of this rank's, `name` holding `text`.
// A file of this process's own (ctest runs this binary twice at once: mpi.pipeline and
// mpi.pipeline_no_single_copy; one removing a shared name failed the other's reads).
std::filesystem::path process_file(const char* name) {
  return mpipe::testing::test_file(cat(name, ".toml"));
}

std::filesystem::path model_file(const char* name, const char* text) {
  const auto path = process_file(name);
  std::ofstream(path) << text;
  return path;
}

// A small CNN with BatchNorm, in a residual block too (2 x 6 x 6 images, 3 classes).
constexpr const char* batchnorm_cnn_text = "input = [2, 6, 6]\n"
                                           "[[layer]]\nkind = \"conv2d\"\nout = 4\nkernel = 3\npadding = 1\n"
                                           "[[layer]]\nkind = \"batchnorm2d\"\n"
                                           "[[layer]]\nkind = \"residual\"\n"
                                           "[[layer.layer]]\nkind = \"conv2d\"\nout = 4\nkernel = 3\npadding = 1\n"
                                           "[[layer.layer]]\nkind = \"batchnorm2d\"\n"
                                           "[[layer]]\nkind = \"global-avgpool\"\n"
                                           "[[layer]]\nkind = \"linear\"\nout = 3\n"
                                           "[[layer]]\nkind = \"cross_entropy\"\n";

// A small CNN with BatchNorm (model file `path`) on K = 2 x D = 2 ranks, running
// statistics moved by `mode` (micro or deferred).
TrainConfig batchnorm_cnn(const std::string& path, const std::string& mode, int steps, float lr) {
  TrainConfig c;
  c.model.kind = path;
  c.batch_size = 16;
  c.micro_batches = 2;
  c.steps = steps;
  c.seed = 5;
  c.threads = 1;
  c.optimizer.lr = lr;
  c.pipeline.grid.replicas = 2;
  c.pipeline.batchnorm = mode;
  return c;
}

}  // namespace

TEST_CASE("partition transparency: K = 1, 2, 4 give bitwise identical losses and parameters") {
  if (world().size() != 4) return;  // the 6-rank run has its own cases
  const RunResult reference = run(tiny_gpt("gpipe", "never"), 1);
  // zb-h1@1f1b: zb-h1 with --in-flight 1f1b (what 1F1B holds on each stage).
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1", "zb-h2", "zb-h1@1f1b"})
    for (const char* remat : {"never", "always", "except-last", "selective"})
      for (int K : {1, 2, 4}) {
        TrainConfig config = tiny_gpt(schedule.substr(0, schedule.find('@')), remat);
        if (schedule.find('@') != std::string::npos) config.pipeline.in_flight = in_flight_of_1f1b;
        const RunResult r = run(config, K);
        if (world().rank() != 0) continue;
        INFO("schedule " << schedule << ", remat " << remat << ", K " << K);
        CHECK(r.losses == reference.losses);
        CHECK(r.norms == reference.norms);
        REQUIRE(r.params.size() == reference.params.size());
        CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
      }
  if (world().rank() == 0) {
    CHECK(reference.losses.back() < reference.losses.front());  // it trained
    CHECK(reference.norms.front() > 0.5);                       // and clipping was exercised
  }
}

TEST_CASE("partition transparency of a ResNet with BatchNorm: K = 1, 2, 4, gpipe and 1f1b, every remat mode, both BatchNorm rules") {
  if (world().size() != 4) return;
  // Selective recomputes each block's inner BatchNorm and ReLU outputs; the deferred
  // last stage runs its forwards in order: the running statistics are never's.
  for (const char* rule : {"micro", "deferred"}) {
    auto config = [&](const char* schedule, const char* remat) {
      TrainConfig c = resnet18(4, 8, 8, 3);
      c.model.classes = 3;
      c.seed = 5;
      c.optimizer.lr = 1e-2f;
      c.pipeline.schedule = schedule;
      c.pipeline.remat = remat;
      c.pipeline.batchnorm = rule;
      return c;
    };
    const RunResult reference = run(config("gpipe", "never"), 1);
    for (const char* schedule : {"gpipe", "1f1b"})
      for (const char* remat : {"never", "selective", "except-last", "always"})
        for (int K : {1, 2, 4}) {
          const RunResult r = run(config(schedule, remat), K);
          if (world().rank() != 0) continue;
          INFO("batchnorm " << rule << ", schedule " << schedule << ", remat " << remat << ", K " << K);
          CHECK(r.losses == reference.losses);
          CHECK(r.norms == reference.norms);
          REQUIRE(r.params.size() == reference.params.size());
          CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
        }
  }
}

TEST_CASE("partition transparency with a cut between a fused BatchNorm and its ReLU: K = 2 gives K = 1's bits") {
  if (world().size() != 4) return;
  // The stem's BatchNorm (layer 1) rectifies for its ReLU (layer 2) at K = 1; cut between
  // them, it rectifies what it sends and the next stage's ReLU rectifies again.
  TrainConfig c = resnet18(4, 8, 8, 3);
  c.model.classes = 3;
  c.seed = 5;
  c.optimizer.lr = 1e-2f;
  const Model model(run_options(c).model);
  REQUIRE(model.layer(1).kind() == "batchnorm2d");
  REQUIRE(model.layer(2).kind() == "relu");
  CHECK(model.fusions() > 0);
  const RunResult reference = run(c, 1);
  c.pipeline.balance = cat(2, ",", model.size() - 2);
  const RunResult cut = run(c, 2);
  if (world().rank() != 0) return;
  CHECK(cut.losses == reference.losses);
  CHECK(cut.norms == reference.norms);
  REQUIRE(cut.params.size() == reference.params.size());
  CHECK(std::memcmp(cut.params.data(), reference.params.data(), cut.params.size() * sizeof(float)) == 0);
}

TEST_CASE("fewer micro-batches than stages (M < K) still trains identically") {
  if (world().size() != 4) return;
  const RunResult reference = run(tiny_gpt("1f1b", "never", 2), 1);
  const RunResult r = run(tiny_gpt("1f1b", "never", 2), 4);
  if (world().rank() == 0) {
    CHECK(r.losses == reference.losses);
    CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("data parallelism: replicas stay bitwise identical; D = 2 matches D = 1 to 1e-6") {
  if (world().size() != 4) return;
  // SGD: AdamW would turn the last-bit differences of gradients that are truly zero
  // (the key bias of attention) into full-size steps of either sign.
  TrainConfig one = tiny_gpt("gpipe", "never", 2);
  one.optimizer.kind = "sgd";
  one.optimizer.lr = 0.1f;
  TrainConfig two = one;
  two.pipeline.grid.replicas = 2;
  const RunResult d1 = run(one, 2);
  const RunResult d2 = run(two, 4);
  TrainConfig four = one;
  four.pipeline.grid.replicas = 4;
  four.micro_batches = 1;
  const RunResult d4 = run(four, 4);
  if (world().rank() == 0) {
    REQUIRE(d2.params.size() == d1.params.size());
    CHECK(std::memcmp(d2.params.data(), d2.replica_params.data(), d2.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(d4.params.data(), d4.replica_params.data(), d4.params.size() * sizeof(float)) == 0);
    for (std::size_t i = 0; i < d1.losses.size(); ++i)
      CHECK(d2.losses[i] == doctest::Approx(d1.losses[i]).epsilon(1e-6));
    CHECK(relative_difference(d2.params, d1.params) < 1e-6);
  }
}

TEST_CASE("rank order data gives the same training as rank order pipeline") {
  if (world().size() != 4) return;
  TrainConfig pipeline_order = tiny_gpt("1f1b", "except-last", 2);
  pipeline_order.pipeline.grid.replicas = 2;
  TrainConfig data_order = pipeline_order;
  data_order.pipeline.grid.rank_order = "data";
  const RunResult a = run(pipeline_order, 4), b = run(data_order, 4);
  if (world().rank() == 0) {
    CHECK(a.losses == b.losses);
    CHECK(std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(b.params.data(), b.replica_params.data(), b.params.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("zb-h1 with two replicas is bitwise gpipe with two replicas, under every remat mode") {
  if (world().size() != 4) return;
  TrainConfig gpipe = tiny_gpt("gpipe", "never", 2);
  gpipe.pipeline.grid.replicas = 2;
  const RunResult reference = run(gpipe, 4);
  for (const char* remat : {"never", "always", "except-last", "selective"}) {
    TrainConfig zb = gpipe;
    zb.pipeline.schedule = "zb-h1";
    zb.pipeline.remat = remat;
    const RunResult r = run(zb, 4);
    if (world().rank() != 0) continue;
    INFO("remat " << remat);
    CHECK(r.losses == reference.losses);
    CHECK(r.norms == reference.norms);
    CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(r.params.data(), r.replica_params.data(), r.params.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("interleaved: v model stages per rank train bitwise as gpipe, every remat mode, K = 1, 2, 4, D = 2") {
  if (world().size() != 4) return;
  auto config = [](const char* schedule, int v, const char* remat) {
    TrainConfig c = tiny_gpt(schedule, remat, 4);
    c.model.layers = 5;  // 9 layers: up to 8 model stages
    c.pipeline.virtual_stages = v;
    return c;
  };
  const RunResult reference = run(config("gpipe", 1, "never"), 1);
  struct Case {
    int ranks, v, replicas;
    const char* remat;
  };
  for (const Case& k : {Case{1, 2, 1, "never"}, Case{2, 2, 1, "never"}, Case{2, 3, 1, "always"}, Case{2, 2, 1, "except-last"},
                        Case{4, 2, 1, "never"}, Case{4, 2, 1, "always"}, Case{4, 2, 2, "except-last"}, Case{2, 2, 1, "selective"}}) {
    TrainConfig c = config("interleaved", k.v, k.remat);
    c.pipeline.grid.replicas = k.replicas;
    c.micro_batches = 4 / k.replicas;  // the same micro-batch size
    if (k.replicas > 1) c.micro_batches = 2;
    const RunResult r = run(c, k.ranks);
    if (world().rank() != 0) continue;
    INFO("ranks " << k.ranks << ", v " << k.v << ", replicas " << k.replicas << ", remat " << k.remat);
    if (k.replicas > 1) {  // another summation order over the replicas: its own reference below
      CHECK(std::memcmp(r.params.data(), r.replica_params.data(), r.params.size() * sizeof(float)) == 0);
      continue;
    }
    CHECK(r.losses == reference.losses);
    CHECK(r.norms == reference.norms);
    REQUIRE(r.params.size() == reference.params.size());
    CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
  }
  // With replicas: interleaved on 2 x 2 ranks is bitwise 1F1B on the same grid.
  TrainConfig d2 = config("1f1b", 1, "never");
  d2.pipeline.grid.replicas = 2;
  d2.micro_batches = 2;
  const RunResult one_f_one_b = run(d2, 4);
  d2.pipeline.schedule = "interleaved";
  d2.pipeline.virtual_stages = 2;
  const RunResult interleaved = run(d2, 4);
  if (world().rank() == 0) {
    CHECK(interleaved.losses == one_f_one_b.losses);
    CHECK(std::memcmp(interleaved.params.data(), one_f_one_b.params.data(), interleaved.params.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("zbv: two model stages per rank in a V train bitwise as gpipe, every remat mode, K = 1, 2, 4, D = 2") {
  if (world().size() != 4) return;
  // 9 layers (embedding, 5 blocks, layernorm, head, loss), or with the head in 3
  // vocabulary chunks 11: up to 8 model stages. The embedding (model stage 0) and the
  // loss (model stage 2K-1) are both on rank 0.
  auto config = [](const char* schedule, const char* remat, int head_chunks) {
    TrainConfig c = tiny_gpt(schedule, remat, 4);
    c.model.layers = 5;
    c.model.head_chunks = head_chunks;
    c.pipeline.virtual_stages = std::string(schedule) == "zbv" ? 2 : 1;
    return c;
  };
  struct Case {
    int ranks, replicas, head_chunks;
    const char* remat;
  };
  const RunResult reference = run(config("gpipe", "never", 1), 1);
  const RunResult chunked = run(config("gpipe", "never", 3), 1);
  for (const Case& k : {Case{1, 1, 1, "never"}, Case{2, 1, 1, "never"}, Case{2, 1, 1, "always"}, Case{2, 1, 3, "except-last"},
                        Case{4, 1, 1, "never"}, Case{4, 1, 1, "except-last"}, Case{4, 1, 3, "always"}, Case{4, 1, 3, "selective"}}) {
    const RunResult r = run(config("zbv", k.remat, k.head_chunks), k.ranks);
    if (world().rank() != 0) continue;
    INFO("ranks " << k.ranks << ", head chunks " << k.head_chunks << ", remat " << k.remat);
    const RunResult& want = k.head_chunks > 1 ? chunked : reference;
    CHECK(r.losses == want.losses);
    CHECK(r.norms == want.norms);
    REQUIRE(r.params.size() == want.params.size());
    CHECK(std::memcmp(r.params.data(), want.params.data(), r.params.size() * sizeof(float)) == 0);
  }
  // With replicas: zbv on 2 x 2 ranks is bitwise gpipe on the same grid, the replicas equal.
  TrainConfig d2 = config("gpipe", "never", 1);
  d2.pipeline.grid.replicas = 2;
  d2.micro_batches = 2;
  const RunResult gpipe = run(d2, 4);
  for (const char* remat : {"never", "always"}) {
    TrainConfig zbv = config("zbv", remat, 1);
    zbv.pipeline.grid.replicas = 2;
    zbv.micro_batches = 2;
    const RunResult r = run(zbv, 4);
    if (world().rank() != 0) continue;
    INFO("D = 2, remat " << remat);
    CHECK(r.losses == gpipe.losses);
    CHECK(r.norms == gpipe.norms);
    CHECK(std::memcmp(r.params.data(), gpipe.params.data(), r.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(r.params.data(), r.replica_params.data(), r.params.size() * sizeof(float)) == 0);
  }
  // The sums over replicas start as each layer's gradient is final, in whatever order the
  // schedule finishes the rank's model stages: here the lower one's last W runs first on
  // both ranks (as the window search of --overlap-steps may order them). The replica sums
  // of that stage once never started, and the replicas drifted apart without a word.
  const std::string path = temp_dir("mpipe-zbv-order") + "/lower-first.txt";
  if (world().rank() == 0) {
    std::ofstream file(path);
    file << "stage 0: 0F0 0F1 3F0 3B0 3F1 3B1 0B0 3W0 0B1 0W0 0W1 3W1\n"
            "stage 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 1W0 1W1 2W1\n";
  }
  world().barrier();
  TrainConfig lower_first = config("zbv", "never", 1);
  lower_first.pipeline.schedule = "file:" + path;
  lower_first.pipeline.grid.replicas = 2;
  lower_first.micro_batches = 2;
  const RunResult r = run(lower_first, 4);
  if (world().rank() == 0) {
    CHECK(r.losses == gpipe.losses);
    CHECK(std::memcmp(r.params.data(), gpipe.params.data(), r.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(r.params.data(), r.replica_params.data(), r.params.size() * sizeof(float)) == 0);
    std::filesystem::remove_all(std::filesystem::path(path).parent_path());
  }
}

TEST_CASE("three replicas: K = 1 and K = 2 stay bitwise identical (mpiexec -n 6)") {
  if (world().size() != 6) return;
  TrainConfig config = tiny_gpt("1f1b", "always", 2);
  config.batch_size = 12;
  config.pipeline.grid.replicas = 3;
  const RunResult k1 = run(config, 3);
  const RunResult k2 = run(config, 6);
  // Sharded over three replicas: pieces of 16 rows are 5, 5 and 6.
  config.pipeline.shard_optimizer = true;
  const RunResult sharded = run(config, 6);
  if (world().rank() == 0) {
    CHECK(k1.losses == k2.losses);
    CHECK(std::memcmp(k1.params.data(), k2.params.data(), k1.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(k2.params.data(), k2.replica_params.data(), k2.params.size() * sizeof(float)) == 0);
    CHECK(sharded.losses == k2.losses);
    CHECK(std::memcmp(sharded.params.data(), k2.params.data(), k2.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(sharded.replica_params.data(), k2.params.data(), k2.params.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("--shard-optimizer: each replica keeps 1/D of the optimizer state and trains bitwise as unsharded") {
  if (world().size() != 4) return;
  // The gradient sums are the unsharded ones; each replica updates its rows of every view
  // (AdamW and SGD are elementwise: the same bits), then the replicas exchange them. So
  // losses, norms and parameters are bitwise those of the same run unsharded, for every
  // schedule, K, D, remat mode, --overlap-steps, and BatchNorm's two rules.
  auto check = [](TrainConfig c, int ranks, const char* what) {
    c.pipeline.shard_optimizer = false;
    const RunResult want = run(c, ranks);
    c.pipeline.shard_optimizer = true;
    const RunResult got = run(c, ranks);
    if (world().rank() != 0) return;
    const int replicas = c.pipeline.grid.replicas;
    INFO(what << ": " << c.pipeline.schedule << ", remat " << c.pipeline.remat << ", " << c.optimizer.kind << ", D = "
              << replicas << " on " << ranks << " ranks");
    REQUIRE(got.losses.size() == want.losses.size());
    CHECK(std::memcmp(got.losses.data(), want.losses.data(), got.losses.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(got.norms.data(), want.norms.data(), got.norms.size() * sizeof(double)) == 0);
    REQUIRE(got.params.size() == want.params.size());
    CHECK(std::memcmp(got.params.data(), want.params.data(), got.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(got.replica_params.data(), want.params.data(), got.params.size() * sizeof(float)) == 0);
    // Rank 0's state: the store's layout unsharded; about 1/D of it sharded (each view's
    // piece padded to 16 floats).
    CHECK(want.state_floats == want.store_floats);
    CHECK(got.state_floats < want.state_floats / static_cast<std::size_t>(replicas) + 16 * 64);
    CHECK(got.state_floats > want.state_floats / static_cast<std::size_t>(replicas) / 2);
  };
  TrainConfig c = tiny_gpt("gpipe", "never", 2);
  c.pipeline.grid.replicas = 2;
  check(c, 2, "K = 1");
  check(c, 4, "K = 2");
  c.pipeline.schedule = "1f1b";
  c.pipeline.remat = "always";
  c.optimizer.kind = "sgd";
  c.optimizer.lr = 0.1f;
  check(c, 4, "K = 2, SGD");
  TrainConfig zb = tiny_gpt("zb-h1", "selective", 4);
  zb.pipeline.grid.replicas = 2;
  check(zb, 4, "zero bubble");
  TrainConfig ahead = tiny_gpt("zb-h2", "never", 4);
  ahead.pipeline.grid.replicas = 2;
  ahead.pipeline.overlap_steps = true;
  ahead.steps = 6;
  ahead.optimizer.clip_grad = 0.8f;  // bets won and lost
  check(ahead, 4, "--overlap-steps");
  TrainConfig chunks = tiny_gpt("1f1b", "never", 2);
  chunks.pipeline.grid.replicas = 2;
  chunks.model.head_chunks = 3;  // the head's vocabulary chunks: rows of the tied table on two stages
  check(chunks, 4, "head in chunks");
  TrainConfig four = tiny_gpt("gpipe", "never", 1);
  four.pipeline.grid.replicas = 4;
  four.model.vocab = 30;  // uneven pieces: 30 rows of the embedding over 4 replicas
  check(four, 4, "D = 4");
  const auto path = model_file("mpipe_shard_bn", "input = [2, 6, 6]\n"
                                                "[[layer]]\nkind = \"conv2d\"\nout = 5\nkernel = 3\npadding = 1\n"
                                                "[[layer]]\nkind = \"batchnorm2d\"\n"
                                                "[[layer]]\nkind = \"global-avgpool\"\n"
                                                "[[layer]]\nkind = \"linear\"\nout = 3\n"
                                                "[[layer]]\nkind = \"cross_entropy\"\n");
  for (const std::string mode : {"micro", "deferred"}) check(batchnorm_cnn(path.string(), mode, 3, 1e-2f), 4, "BatchNorm");
  std::filesystem::remove(path);
}

TEST_CASE("--shard-optimizer checkpoints: each replica writes its rows, the file is the unsharded one, and it loads onto any D and K") {
  if (world().size() != 4) return;
  // D = 4 x K = 1 writes the same file sharded (every replica its rows of /optimizer) and
  // unsharded (replica 0 all of it): every dataset and checksum alike. It loads at
  // D = 1 x K = 4; and a file written at K = 4 continues at D = 2 x K = 2 sharded bitwise
  // as unsharded, the state each replica loaded being its rows of the file's.
  const std::string sharded_dir = temp_dir("mpipe-shard"), plain_dir = temp_dir("mpipe-plain");
  TrainConfig c = tiny_gpt("gpipe", "never", 1);
  c.model.vocab = 30;  // uneven pieces
  c.pipeline.grid.replicas = 4;
  c.pipeline.shard_optimizer = true;
  c.checkpoint_dir = sharded_dir;
  const std::vector<float> written = train_and_save(c, 2);
  // The pieces through HDF5's MPI-IO driver (hyperslabs of rows), not direct I/O.
  const std::string buffered_dir = temp_dir("mpipe-shard-buffered");
  c.checkpoint_dir = buffered_dir;
  setenv("MPIPE_CHECKPOINT_BUFFERED", "1", 1);
  train_and_save(c, 2);
  unsetenv("MPIPE_CHECKPOINT_BUFFERED");
  c.pipeline.shard_optimizer = false;
  c.checkpoint_dir = plain_dir;
  train_and_save(c, 2);
  const Model model(c.model);
  const std::vector<std::string> states{"exp_avg", "exp_avg_sq"};
  if (world().rank() == 0) {
    const auto b = checkpoint_datasets(checkpoint_path(plain_dir, 2), model, states);
    for (const std::string& dir : {sharded_dir, buffered_dir}) {
      CAPTURE(dir);
      const auto a = checkpoint_datasets(checkpoint_path(dir, 2), model, states);
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        CAPTURE(i);
        REQUIRE(a[i].size() == b[i].size());
        CHECK(std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) == 0);
      }
    }
  }
  TrainConfig k4 = c;  // one replica (nothing to shard), four stages
  k4.pipeline.grid.replicas = 1;
  k4.micro_batches = 4;
  {  // D = 4 sharded -> D = 1 x K = 4
    Executor reader(plan_run(k4, world()), world());
    reader.connect();
    reader.allocate();
    CHECK(load_checkpoint(reader, checkpoint_path(sharded_dir, 2)) == 2);
    const std::vector<float> loaded = gather_params(reader, world(), 0);
    if (world().rank() == 0) CHECK(std::memcmp(loaded.data(), written.data(), loaded.size() * sizeof(float)) == 0);
  }
  // K = 4 -> D = 2 x K = 2, sharded and not, two more steps each.
  const std::string from_k4 = temp_dir("mpipe-k4");
  k4.checkpoint_dir = from_k4;
  train_and_save(k4, 2);
  std::vector<std::vector<float>> continued;
  for (const bool shard : {false, true}) {
    TrainConfig d2 = c;
    d2.pipeline.grid.stages = 2;
    d2.pipeline.grid.replicas = 2;
    d2.micro_batches = 2;
    d2.pipeline.shard_optimizer = shard;
    Executor e(plan_run(d2, world()), world());
    e.connect();
    e.allocate();
    CHECK(load_checkpoint(e, checkpoint_path(from_k4, 2)) == 2);
    for (int step = 2; step < 4; ++step) e.step(step);
    continued.push_back(gather_params(e, world(), 1));
  }
  if (world().rank() == 0) {
    REQUIRE(continued[0].size() == continued[1].size());
    CHECK(std::memcmp(continued[0].data(), continued[1].data(), continued[0].size() * sizeof(float)) == 0);
    CHECK(continued[0] != written);
    for (const std::string& dir : {sharded_dir, buffered_dir, plain_dir, from_k4}) std::filesystem::remove_all(dir);
  }
}

TEST_CASE("a checkpoint written with K = 4 loads bitwise into K = 2 x D = 2") {
  if (world().size() != 4) return;
  const std::string dir = temp_dir("mpipe-reshard");
  TrainConfig config = tiny_gpt("gpipe", "never");
  config.checkpoint_dir = dir;
  const std::vector<float> saved = train_and_save(config, 2);
  std::vector<float> loaded;
  TrainConfig other = config;
  other.pipeline.grid.stages = 2;
  other.pipeline.grid.replicas = 2;
  other.micro_batches = 2;
  Executor reader(plan_run(other, world()), world());
  reader.connect();
  reader.allocate();
  CHECK(load_checkpoint(reader, checkpoint_path(dir, 2)) == 2);
  CHECK(reader.updates() == 2);
  loaded = gather_params(reader, world(), 0);
  const std::vector<float> replica = gather_params(reader, world(), 1);
  if (world().rank() == 0) {
    REQUIRE(saved.size() == loaded.size());
    CHECK(std::memcmp(saved.data(), loaded.data(), saved.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(saved.data(), replica.data(), saved.size() * sizeof(float)) == 0);
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("mpipe export, then --init-from on another grid: the checkpoint's weights bitwise (GPT-2's names, a CNN's own with its running statistics)") {
  if (world().size() != 4) return;
  const auto cnn = model_file("export_cnn", batchnorm_cnn_text);
  struct Case {
    const char* name;
    TrainConfig write, read;
  };
  TrainConfig gpt4 = tiny_gpt("gpipe", "never"), gpt22 = gpt4, cnn22 = batchnorm_cnn(cnn.string(), "micro", 2, 1e-2f), cnn4 = cnn22;
  gpt4.pipeline.grid = GridShape{.stages = 4, .replicas = 1};
  gpt22.pipeline.grid = GridShape{.stages = 2, .replicas = 2};
  gpt22.micro_batches = 2;
  cnn4.pipeline.grid = GridShape{.stages = 4, .replicas = 1};
  std::vector<std::string> exports;
  for (Case& k : std::vector<Case>{{"gpt", gpt4, gpt22}, {"cnn", cnn22, cnn4}}) {
    INFO(k.name);
    const std::string dir = temp_dir("mpipe-export");
    k.write.checkpoint_dir = dir;
    const std::vector<float> saved = train_and_save(k.write, 2);
    const std::string out = dir + "/weights.safetensors";
    int code = -1;
    if (world().rank() == 0) code = run_export(checkpoint_path(dir, 2), out);
    world().broadcast(std::span<int>(&code, 1), 0);
    REQUIRE(code == 0);
    Executor reader(plan_run(k.read, world()), world());
    reader.connect();
    reader.allocate();
    load_weights(reader, out);
    const std::vector<float> loaded = gather_params(reader, world(), 0), replica = gather_params(reader, world(), 1);
    if (world().rank() == 0) {
      REQUIRE(saved.size() == loaded.size());
      CHECK(std::memcmp(saved.data(), loaded.data(), saved.size() * sizeof(float)) == 0);
      if (k.read.pipeline.grid.replicas > 1) CHECK(std::memcmp(saved.data(), replica.data(), saved.size() * sizeof(float)) == 0);
    }
    CHECK(reader.updates() == 0);  // a fresh optimizer
    exports.push_back(out);
  }
  // One model's file for the other: refused by the first name it lacks, on every rank.
  Executor gpt(plan_run(gpt22, world()), world());
  gpt.connect();
  gpt.allocate();
  try {
    load_weights(gpt, exports[1]);
    CHECK_MESSAGE(false, "a CNN's weights loaded into a GPT");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("has no tensor 'transformer.") != std::string::npos);
  }
  world().barrier();
  if (world().rank() == 0)
    for (const std::string& out : exports) std::filesystem::remove_all(std::filesystem::path(out).parent_path());
}

TEST_CASE("the tied head keeps the embedding's values on another stage") {
  if (world().size() != 4) return;
  const Communicator sub = Communicator::split(world(), world().rank() < 2 ? 0 : MPI_UNDEFINED, world().rank());
  if (sub.null()) return;
  TrainConfig c = tiny_gpt("gpipe", "never");
  Executor e(plan_run(c, sub), sub);
  e.connect();
  e.allocate();
  for (int step = 0; step < 3; ++step) e.step(step);
  // Stage 0 sends wte; stage 1 compares its head copy bitwise.
  const ParamEntry* wte = nullptr;
  const ParamEntry* head = nullptr;
  for (const ParamEntry& entry : e.params().entries()) {
    if (entry.layer == 0 && entry.name == "wte") wte = &entry;
    if (entry.tied_copy) head = &entry;
  }
  if (e.grid().stage() == 0) {
    REQUIRE(wte);
    MPI_Send(e.params().param(*wte).f32(), static_cast<int>(wte->numel()), MPI_FLOAT, 1, 0, sub.get());
  } else {
    REQUIRE(head);
    CHECK(!head->alias);
    std::vector<float> owner(static_cast<std::size_t>(head->numel()));
    MPI_Recv(owner.data(), static_cast<int>(owner.size()), MPI_FLOAT, 0, 0, sub.get(), MPI_STATUS_IGNORE);
    CHECK(std::memcmp(owner.data(), e.params().param(*head).f32(), owner.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("a message moves while its sender computes, with a progress thread or tests between layers") {
  if (world().size() != 4) return;
  // Pairs (0, 1) and (2, 3): the first rank sends 4 MiB and computes for 1 s without
  // entering MPI (but for Progress::poll() between 10 ms "layers"); the second waits.
  // With progress the message arrives long before the compute ends. Where shared memory
  // copies by itself (CMA) it arrives early anyway; without single-copy (the
  // mpi.pipeline_no_single_copy run) the waits-only control shows it would not.
  using Clock = std::chrono::steady_clock;
  const Communicator pair = Communicator::split(world(), world().rank() / 2, world().rank());
  const char* single_copy = std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism");
  const bool needs_sender = single_copy && std::string(single_copy) == "none";
  std::vector<float> message(1 << 20, 1.0f), work(1 << 18, 1.0f);
  const std::span<std::byte> wire = std::as_writable_bytes(std::span<float>(message));
  for (ProgressMode mode : {ProgressMode::thread, ProgressMode::layers, ProgressMode::waits}) {
    Progress progress(mode, 1e-3, 2, false);  // 4 ranks may share 2 cores
    Progress::Ticket ticket = Progress::none;
    if (pair.rank() == 1) ticket = progress.track(pair.irecv(wire, 0, 3), true);
    pair.barrier();
    const auto start = Clock::now();
    double arrived = 0;
    if (pair.rank() == 0) {
      ticket = progress.track(pair.isend(wire, 1, 3), true);
      float acc = 0;
      while (Clock::now() - start < std::chrono::seconds(1)) {
        const auto layer = Clock::now();
        while (Clock::now() - layer < std::chrono::milliseconds(10))
          for (float& w : work) acc += w, w = acc * 1e-9f;
        progress.poll();
      }
      progress.wait(ticket, 60, "the send", 0);
    } else {
      progress.wait(ticket, 60, "the message", 0, static_cast<long>(wire.size()));
      arrived = std::chrono::duration<double>(Clock::now() - start).count();
    }
    pair.broadcast(std::span<double>(&arrived, 1), 1);
    INFO("mode ", std::string(to_string(mode)), ", arrived after ", arrived, " s of the sender's 1 s of compute");
    if (mode != ProgressMode::waits) CHECK(arrived < 0.5);
    else if (needs_sender) CHECK(arrived >= 1.0);
  }
}

namespace {
// Rank r's value at i: magnitudes far apart across ranks, so that another order of the
// sum gives other bits. Not inlined: the compiler would fuse its product with the add of
// an expected sum (an FMA), which the sums under test never see.
[[gnu::noinline]] float group_value(int r, std::size_t i) {
  const auto h = static_cast<std::uint32_t>(i * 2654435761u + static_cast<std::uint32_t>(r) * 40503u);
  return (static_cast<float>(h % 20011) / 20011.0f - 0.37f) * std::pow(10.0f, static_cast<float>((r * 3 + i) % 7) - 3.0f);
}
}  // namespace

TEST_CASE("a group sum over 2, 3 and 4 ranks: every rank ends with x0 + x1 + ... in rank order, bitwise, in every progress mode") {
  if (world().size() != 4) return;
  for (const int D : {4, 3, 2}) {
    const Communicator group = Communicator::split(world(), world().rank() < D ? 0 : MPI_UNDEFINED, world().rank());
    if (group.null()) continue;
    for (const std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{1001}, std::size_t{262147}}) {
      std::vector<float> expected(n);
      for (std::size_t i = 0; i < n; ++i) {
        float acc = group_value(0, i);
        for (int r = 1; r < D; ++r) acc += group_value(r, i);
        expected[i] = acc;
      }
      for (ProgressMode mode : {ProgressMode::thread, ProgressMode::layers, ProgressMode::waits}) {
        CAPTURE(D);
        CAPTURE(n);
        CAPTURE(std::string(to_string(mode)));
        Progress progress(mode, 1e-3, GroupSum::requests(D), false);
        std::vector<float> values(n);
        GroupSum sum(group, progress, MessagePath{}, values, 10);
        for (int round = 0; round < 2; ++round) {  // the same object again, as every step
          for (std::size_t i = 0; i < n; ++i) values[i] = group_value(group.rank(), i);
          if (group.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a late rank
          sum.start();
          CHECK(sum.started());
          for (int k = 0; k < 20; ++k) {  // as between layers: the second phase may begin here
            progress.poll();
            sum.advance();
          }
          sum.finish(60, "the group sum", round);
          CHECK(!sum.started());
          CHECK(std::memcmp(values.data(), expected.data(), n * sizeof(float)) == 0);
        }
      }
    }
  }
}

TEST_CASE("a pair sum moves a large span in pieces, each added as it arrives: both ranks end with a + b, bitwise") {
  if (world().size() != 4) return;
  CHECK(PairSum::pieces(1) == 1);
  CHECK(PairSum::pieces(PairSum::min_piece_floats * 5 / 2) == 2);
  CHECK(PairSum::pieces(PairSum::min_piece_floats * 100) == PairSum::max_pieces);
  const Communicator pair = Communicator::split(world(), world().rank() / 2, world().rank());
  for (const std::size_t n : {std::size_t{1001}, PairSum::min_piece_floats * 5 / 2 + 3}) {
    for (ProgressMode mode : {ProgressMode::thread, ProgressMode::waits}) {
      CAPTURE(n);
      CAPTURE(std::string(to_string(mode)));
      std::vector<float> values(n), expected(n);
      for (std::size_t i = 0; i < n; ++i) {
        values[i] = group_value(pair.rank(), i);
        expected[i] = group_value(0, i) + group_value(1, i);
      }
      Progress progress(mode, 1e-3, PairSum::requests(n), false);
      PairSum sum(pair, 1 - pair.rank(), progress, MessagePath{}, values, 4);
      sum.post_receive();
      pair.barrier();
      sum.start();
      sum.finish(60, "the pair sum", 0);
      CHECK(std::memcmp(values.data(), expected.data(), n * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("the watchdog's heartbeats keep guarded work longer than the liveness time alive") {
  // Liveness 0.3 s, deadline 30 s: work of 1.2 s on every rank must not end the job
  // (without heartbeats rank 0 would name a silent rank after 0.3 s and MPI_Abort).
  Watchdog dog(world(), cat("rank ", world().rank()), 0.3);
  REQUIRE(dog.heartbeats());  // 4 ranks under MPI_THREAD_MULTIPLE
  world().barrier();           // armed together, as after a checkpoint's rendezvous
  {
    const auto guard = dog.arm("work outside MPI", 30);
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  }
  // A word every 75 ms each way: rank 0 heard each of the others, they heard rank 0.
  const long expected = world().rank() == 0 ? 8L * (world().size() - 1) : 8L;
  CHECK(dog.words_heard() >= expected);
  // Armed again: rank 0 works while the others wait in a collective, whose MPI calls
  // run beside the watchdog threads'.
  world().barrier();
  {
    const auto guard = dog.arm("a wait inside MPI", 30);
    if (world().rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    world().barrier();
  }
  int alive = 1;
  world().allreduce(std::span<int>(&alive, 1), Reduce::sum);
  CHECK(alive == world().size());
}

TEST_CASE("BatchNorm with replicas: every replica ends each step with the same running statistics") {
  if (world().size() != 4) return;
  // A CNN with BatchNorm (in a residual block too), K = 2 x D = 2: the replicas see other
  // micro-batches; micro: they average their statistics after each update; deferred:
  // they add up the step's sums and apply the same.
  const auto path = model_file("mpipe_bn", batchnorm_cnn_text);
  std::vector<float> micro;
  for (const std::string mode : {"micro", "deferred"}) {
    CAPTURE(mode);
    const RunResult r = run(batchnorm_cnn(path.string(), mode, 3, 1e-2f), 4);
    if (world().rank() == 0) {
      REQUIRE(r.params.size() == r.replica_params.size());
      CHECK(std::memcmp(r.params.data(), r.replica_params.data(), r.params.size() * sizeof(float)) == 0);
      // The running statistics moved: some value is neither its initial 0 nor 1.
      bool moved = false;
      for (float v : r.params) moved = moved || (v != 0.0f && v != 1.0f && std::fabs(v) < 0.5f);
      CHECK(moved);
      if (mode == "micro") micro = r.params;
      else CHECK(micro != r.params);  // deferred moves them otherwise
    }
  }
  std::filesystem::remove(path);
}

TEST_CASE("--prefetch on: each batch read during the step before trains bitwise as read at its step") {
  if (world().size() != 4) return;
  // Token windows (GPT) and synthetic images (a CNN with BatchNorm), K = 2 x D = 2 (each
  // replica reads its own share), and --overlap-steps with every bet lost: each step's
  // pass runs again after its roll-back, a batch asked for twice (the second time not
  // the one read ahead). Every read but the first is read ahead with no roll-back.
  const auto path = model_file("mpipe_prefetch", batchnorm_cnn_text);
  TrainConfig gpt = tiny_gpt("1f1b", "never", 2);
  gpt.pipeline.grid.replicas = 2;
  TrainConfig lost = tiny_gpt("gpipe", "never", 2);
  lost.pipeline.grid.replicas = 2;
  lost.pipeline.overlap_steps = true;
  lost.optimizer.clip_grad = 0.5f;  // above this model's norm: every bet lost, every step run twice
  const TrainConfig cnn = batchnorm_cnn(path.string(), "micro", 4, 1e-2f);
  for (const auto& [config, what] : {std::pair{gpt, "gpt"}, std::pair{lost, "gpt, --overlap-steps, bets lost"},
                                     std::pair{cnn, "cnn"}}) {
    CAPTURE(what);
    TrainConfig c = config;
    c.prefetch = "off";
    const RunResult want = run(c, 4);
    c.prefetch = "on";
    const RunResult got = run(c, 4);
    if (world().rank() != 0) continue;
    CHECK_FALSE(want.prefetching);
    CHECK(got.prefetching);
    CHECK(got.losses == want.losses);
    CHECK(got.norms == want.norms);
    REQUIRE(got.params.size() == want.params.size());
    CHECK(std::memcmp(got.params.data(), want.params.data(), got.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(got.replica_params.data(), want.replica_params.data(), got.params.size() * sizeof(float)) == 0);
    if (c.pipeline.overlap_steps) CHECK(got.rolled_back == want.rolled_back);
    else CHECK(got.prefetched == c.steps - 1);
    CHECK(got.prefetched >= 1);
  }
  std::filesystem::remove(path);
}

TEST_CASE("1F1B holds the activations of K - stage micro-batches, GPipe of all M, zb-h1 of K, or K - stage at 1F1B's memory") {
  if (world().size() != 4) return;
  // K = 4, M = 8, no remat: a micro-batch's activations are freed after its backward, so
  // stage 0 holds 4 under 1f1b where gpipe holds 8 (the same sizes each: about half).
  std::size_t peak[4] = {0, 0, 0, 0};
  std::vector<double> losses[4];
  for (int i = 0; i < 4; ++i) {
    TrainConfig c = tiny_gpt(i == 0 ? "gpipe" : i == 1 ? "1f1b" : "zb-h1", "never", 8);
    if (i == 3) c.pipeline.in_flight = in_flight_of_1f1b;
    c.batch_size = 64;
    Executor exec(plan_run(c, world()), world());
    exec.connect();
    exec.allocate();
    for (int step = 0; step < 2; ++step) losses[i].push_back(exec.step(step).loss);
    peak[i] = exec.peak_activation_bytes();
  }
  CHECK(losses[0] == losses[1]);
  CHECK(losses[0] == losses[2]);
  CHECK(losses[0] == losses[3]);
  const int stage = world().rank();  // one replica: rank = stage
  const double ratio = static_cast<double>(peak[1]) / static_cast<double>(peak[0]);
  const double zb = static_cast<double>(peak[2]) / static_cast<double>(peak[0]);
  CAPTURE(stage);
  CAPTURE(ratio);
  CAPTURE(zb);
  if (stage == 0) CHECK(ratio < 0.65);
  CHECK(ratio <= 1.0);
  // zb-h1 holds up to K micro-batches on every stage until their W, and the output
  // gradients W needs, most of them in forward buffers B is done with (measured on stage
  // 0: 0.56 of gpipe's against 1f1b's 0.54; 0.75 while each Linear took stash memory).
  if (stage == 0) CHECK(zb < 0.6);
  CHECK(zb < 1.0);
  // --in-flight 1f1b: each stage holds from F to W what 1F1B holds from F to B, and its
  // split B takes the scratch of 1F1B's fused backward: no stage needs more memory than
  // the output gradients its W keeps (the plan's stash) for the K - stage micro-batches
  // between their B and W. (A block's fc_proj dy: the attention keeps only its (B, H, T)
  // log-sum-exp, no (T, T) buffer for it to move into.)
  CAPTURE(peak[3]);
  CAPTURE(peak[1]);
  double stash = 0;
  {
    TrainConfig c = tiny_gpt("zb-h1", "never", 8);
    c.batch_size = 64;
    const Plan plan = plan_run(c, world());
    for (const int m : plan.schedule.stages_of(stage)) stash += plan.memory[static_cast<std::size_t>(m)].stash;
    CAPTURE(stash);
    if (stage == 0) CHECK(stash > 0);  // a block's (the later stages: layernorm, head, loss)
  }
  CHECK(static_cast<double>(peak[3]) <= static_cast<double>(peak[1]) + (world().size() - stage) * stash);
  if (stage == world().size() - 1) CHECK(peak[3] < peak[2]);  // zb-h1's own holds K there, 1F1B one
}

TEST_CASE("1F1B's memory does not grow with M: what a stage sends comes from a ring of buffers, not one per micro-batch") {
  if (world().size() != 4) return;
  // K = 4, micro-batches of 2 samples, M = 8 and 32: every stage past the first keeps each
  // B's input gradient until its send completes, and under remat every stage but the last
  // each forward's output; both now take a few buffers in turn.
  for (const std::string remat : {"never", "always"}) {
    std::size_t peak[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
      const int M = i == 0 ? 8 : 32;
      TrainConfig c = tiny_gpt("1f1b", remat, M);
      c.batch_size = 2 * M;
      Executor exec(plan_run(c, world()), world());
      exec.connect();
      exec.allocate();
      for (int step = 0; step < 2; ++step) exec.step(step);
      peak[i] = exec.peak_activation_bytes();
    }
    CAPTURE(remat);
    CAPTURE(world().rank());
    CHECK(peak[1] == peak[0]);  // it was about 4 times as much at M = 32 on the later stages
  }
}

TEST_CASE("a head split over the vocabulary: chunks on stages apart train bitwise as on one rank; K = 4 reloads as K = 2 x D = 2") {
  if (world().size() != 4) return;
  // 9 layers: embedding, 3 blocks, layernorm, 3 chunks of the 32-token head (rows 0-9,
  // 10-20, 21-31 of the token table), loss.
  auto config = [](const char* schedule, const char* remat, const char* balance) {
    TrainConfig c = tiny_gpt(schedule, remat, 4);
    c.model.head_chunks = 3;
    c.pipeline.balance = balance;
    return c;
  };
  const RunResult reference = run(config("gpipe", "never", ""), 1);
  // K = 2: chunk 0 beside the embedding (an alias), chunks 1 and 2 on stage 1. K = 4:
  // chunks 0 and 1 on stage 2, chunk 2 and the loss on stage 3: the embedding's stage
  // sums rows with two others.
  struct Case {
    const char* schedule;
    const char* remat;
    int ranks;
    const char* balance;
  };
  for (const Case& k : {Case{"gpipe", "never", 2, "6,3"}, Case{"1f1b", "always", 2, "6,3"}, Case{"gpipe", "never", 4, "2,2,3,2"},
                        Case{"zb-h1", "except-last", 4, "2,2,3,2"}, Case{"1f1b", "never", 4, "1,4,2,2"}}) {
    const RunResult r = run(config(k.schedule, k.remat, k.balance), k.ranks);
    if (world().rank() != 0) continue;
    INFO(k.schedule << ", remat " << k.remat << ", K " << k.ranks << ", balance " << k.balance);
    CHECK(r.losses == reference.losses);
    CHECK(r.norms == reference.norms);
    REQUIRE(r.params.size() == reference.params.size());
    CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
  }
  if (world().rank() == 0) CHECK(reference.losses.back() < reference.losses.front());

  // Two replicas: each replica's stages sum their own rows; K = 2 is bitwise K = 1.
  TrainConfig d2 = config("1f1b", "never", "");
  d2.pipeline.grid.replicas = 2;
  d2.micro_batches = 2;
  const RunResult k1 = run(d2, 2);
  d2.pipeline.balance = "6,3";
  const RunResult k2 = run(d2, 4);
  if (world().rank() == 0) {
    CHECK(k2.losses == k1.losses);
    CHECK(std::memcmp(k2.params.data(), k1.params.data(), k1.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(k2.params.data(), k2.replica_params.data(), k2.params.size() * sizeof(float)) == 0);
  }

  // Every copy on another stage holds exactly its rows of the embedding after training.
  {
    TrainConfig c = config("1f1b", "never", "2,2,3,2");
    Executor e(plan_run(c, world()), world());
    e.connect();
    e.allocate();
    for (int step = 0; step < 3; ++step) e.step(step);
    std::vector<float> wte(32 * 16);
    if (e.grid().stage() == 0)
      for (const ParamEntry& entry : e.params().entries())
        if (entry.layer == 0 && entry.name == "wte") std::memcpy(wte.data(), e.params().param(entry).f32(), wte.size() * sizeof(float));
    world().broadcast(std::span<float>(wte), 0);
    int copies = 0;
    for (const ParamEntry& entry : e.params().entries())
      if (entry.tied_copy) {
        ++copies;
        CHECK(!entry.alias);
        CHECK(entry.owner_element % 16 == 0);
        CHECK(std::memcmp(wte.data() + entry.owner_element, e.params().param(entry).f32(), entry.numel() * sizeof(float)) == 0);
      }
    CHECK(copies == (e.grid().stage() == 2 ? 2 : e.grid().stage() == 3 ? 1 : 0));
  }

  // A checkpoint of the split head, written by K = 4, loads bitwise into K = 2 x D = 2.
  const std::string dir = temp_dir("mpipe-vocab");
  TrainConfig c = config("gpipe", "never", "2,2,3,2");
  c.checkpoint_dir = dir;
  const std::vector<float> saved = train_and_save(c, 2);
  TrainConfig other = c;
  other.pipeline.balance = "6,3";
  other.pipeline.grid.stages = 2;
  other.pipeline.grid.replicas = 2;
  other.micro_batches = 2;
  Executor reader(plan_run(other, world()), world());
  reader.connect();
  reader.allocate();
  CHECK(load_checkpoint(reader, checkpoint_path(dir, 2)) == 2);
  const std::vector<float> loaded = gather_params(reader, world(), 0), replica = gather_params(reader, world(), 1);
  // The copies too: stage 1 of each replica holds chunks 1 and 2, read from the rows of
  // the embedding's dataset.
  std::vector<float> wte(32 * 16);
  if (reader.grid().stage() == 0)
    for (const ParamEntry& entry : reader.params().entries())
      if (entry.layer == 0 && entry.name == "wte") std::memcpy(wte.data(), reader.params().param(entry).f32(), wte.size() * sizeof(float));
  reader.grid().pipeline().broadcast(std::span<float>(wte), 0);
  int copies = 0;
  for (const ParamEntry& entry : reader.params().entries())
    if (entry.tied_copy && !entry.alias) {
      ++copies;
      CHECK(std::memcmp(wte.data() + entry.owner_element, reader.params().param(entry).f32(), entry.numel() * sizeof(float)) == 0);
    }
  CHECK(copies == (reader.grid().stage() == 1 ? 2 : 0));
  if (world().rank() == 0) {
    REQUIRE(saved.size() == loaded.size());
    CHECK(std::memcmp(saved.data(), loaded.data(), saved.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(saved.data(), replica.data(), saved.size() * sizeof(float)) == 0);
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("--overlap-steps: updates made ahead of the agreement train bitwise as without, bets won and lost") {
  if (world().size() != 4) return;
  // Each rank updates as soon as its part of a step is done and checks the bet (finite,
  // within --clip-grad) after its next pass. Clip 0: every bet won; 0.5: every bet lost
  // (this model's norm is above it); the median norm: some of each; lr 1e30: non-finite
  // steps, skipped. Bitwise against the same run without overlap, for gpipe, zb-h2 and
  // zbv on 2 and 4 ranks, with two replicas, and BatchNorm (micro and deferred).
  auto same_bits = [](const std::vector<double>& a, const std::vector<double>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
  };
  auto check = [&](TrainConfig c, int ranks, const char* what) {
    c.pipeline.overlap_steps = false;
    const RunResult want = run(c, ranks);
    c.pipeline.overlap_steps = true;
    const RunResult got = run(c, ranks);
    if (world().rank() != 0) return got;
    INFO(what << ", " << c.pipeline.schedule << " on " << ranks << " ranks, clip " << c.optimizer.clip_grad << ", lr "
              << c.optimizer.lr);
    CHECK(same_bits(got.losses, want.losses));
    CHECK(same_bits(got.norms, want.norms));
    CHECK(got.skipped == want.skipped);
    REQUIRE(got.params.size() == want.params.size());
    CHECK(std::memcmp(got.params.data(), want.params.data(), got.params.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(got.replica_params.data(), want.replica_params.data(), got.params.size() * sizeof(float)) == 0);
    CHECK(got.speculated >= 1);
    return got;
  };
  auto gpt = [](const char* schedule) {
    TrainConfig c = tiny_gpt(schedule, "never", 4);
    c.model.layers = 5;  // 9 layers: zbv on 4 ranks needs 8 model stages
    c.steps = 7;
    c.pipeline.virtual_stages = std::string(schedule) == "zbv" ? 2 : 1;
    return c;
  };
  // The median of a run's gradient norms (known on rank 0), on every rank.
  auto median_norm = [](const RunResult& r, int steps) {
    std::vector<double> norms = r.norms;
    norms.resize(static_cast<std::size_t>(steps));
    world().broadcast(std::span<double>(norms), 0);
    std::sort(norms.begin(), norms.end());
    return static_cast<float>(norms[norms.size() / 2]);
  };
  struct Case {
    const char* schedule;
    int ranks, replicas;
  };
  float median = 0;
  RunResult reference_zbv;  // zbv on 4 ranks at its median clip without --in-flight: the same losses with it
  float zbv_clip = 0;
  for (const Case& k : {Case{"gpipe", 2, 1}, Case{"zb-h2", 2, 1}, Case{"zb-h2", 4, 1}, Case{"zbv", 2, 1}, Case{"zbv", 4, 1},
                        Case{"zb-h2", 4, 2}}) {
    TrainConfig c = gpt(k.schedule);
    c.pipeline.grid.replicas = k.replicas;
    if (k.replicas > 1) c.micro_batches = 2;
    c.optimizer.clip_grad = 0.0f;
    const RunResult won = check(c, k.ranks, "every bet won");
    if (world().rank() == 0) CHECK(won.rolled_back == 0);
    median = median_norm(won, c.steps);
    c.optimizer.clip_grad = 0.5f;
    const RunResult lost = check(c, k.ranks, "every bet lost");
    if (world().rank() == 0) CHECK(lost.rolled_back >= 1);
    c.optimizer.clip_grad = median;
    const RunResult mixed = check(c, k.ranks, "some bets lost");
    if (std::string(k.schedule) == "zbv" && k.ranks == 4) reference_zbv = mixed, zbv_clip = median;
    if (world().rank() == 0) CHECK((mixed.rolled_back >= 1 && mixed.rolled_back < mixed.speculated));
  }
  {
    TrainConfig c = gpt("zbv");  // 3K model stages between F and W: back to back without bubble
    c.pipeline.in_flight = 12;
    c.optimizer.clip_grad = zbv_clip;
    const RunResult r = check(c, 4, "zbv --in-flight 12, some bets lost");
    if (world().rank() == 0) CHECK(r.losses == reference_zbv.losses);
  }
  {
    TrainConfig c = gpt("zb-h2");  // SGD: one optimizer state, not two
    c.optimizer.kind = "sgd";
    c.optimizer.momentum = 0.9f;
    c.optimizer.clip_grad = median;
    const RunResult r = check(c, 4, "SGD, some bets lost");
    if (world().rank() == 0) CHECK(r.rolled_back >= 1);
  }
  {
    TrainConfig c = gpt("zb-h2");
    c.optimizer.clip_grad = 0.0f;
    c.optimizer.lr = 1e30f;  // the first update overflows: the steps after it are non-finite
    const RunResult r = check(c, 4, "non-finite steps");
    if (world().rank() == 0) {
      CHECK(r.rolled_back >= 1);
      CHECK(std::count(r.skipped.begin(), r.skipped.end(), 1) >= 1);
    }
  }
  // BatchNorm: running statistics as the agreed update leaves them, after a lost bet too.
  const auto path = process_file("mpipe_bn_overlap");
  std::ofstream(path) << "input = [2, 6, 6]\n"
                         "[[layer]]\nkind = \"conv2d\"\nout = 4\nkernel = 3\npadding = 1\n"
                         "[[layer]]\nkind = \"batchnorm2d\"\n"
                         "[[layer]]\nkind = \"global-avgpool\"\n"
                         "[[layer]]\nkind = \"linear\"\nout = 3\n"
                         "[[layer]]\nkind = \"cross_entropy\"\n";
  for (const std::string mode : {"micro", "deferred"}) {
    TrainConfig c = batchnorm_cnn(path.string(), mode, 6, 5e-2f);
    c.pipeline.schedule = "zb-h2";
    c.optimizer.clip_grad = 0.0f;
    const RunResult won = check(c, 4, mode == "micro" ? "BatchNorm micro" : "BatchNorm deferred");
    c.optimizer.clip_grad = median_norm(won, c.steps);
    const RunResult mixed = check(c, 4, mode == "micro" ? "BatchNorm micro, some bets lost" : "BatchNorm deferred, some bets lost");
    if (world().rank() == 0) CHECK(mixed.rolled_back >= 1);
    c.optimizer.clip_grad = 0.0f;
    c.optimizer.lr = 1e30f;  // non-finite steps: the running statistics as a skip leaves them
    const RunResult skipped = check(c, 4, mode == "micro" ? "BatchNorm micro, non-finite" : "BatchNorm deferred, non-finite");
    if (world().rank() == 0) CHECK(std::count(skipped.skipped.begin(), skipped.skipped.end(), 1) >= 1);
  }
  std::filesystem::remove(path);
}

namespace {

// Two steps of `c` on this world: this rank's stage, its measured peak activation memory
// and the plan's figure for it.

}  // namespace

TEST_CASE("plan's activation memory per rank is the measured peak within 10% (GPT: never, selective) or 15% (always)") {
  if (world().size() != 4) return;
  // K = 4, gpipe, M = 8: every stage holds all 8 micro-batches (never, selective) or
  // their inputs and one recomputation (always); a block or two per stage.
  for (const char* remat : {"never", "selective", "always"}) {
    TrainConfig c = test::tiny_gpt({.layers = 4, .d_model = 64, .heads = 4, .seq_len = 64, .vocab = 64, .dropout = 0.1f,
                                    .batch_size = 16, .micro_batches = 8, .steps = 2, .seed = 5});
    c.threads = 1;
    c.pipeline.remat = remat;
    const PeakMemory peak = peak_memory(c);
    CAPTURE(remat);
    CAPTURE(peak.stage);
    CAPTURE(peak.measured);
    CAPTURE(peak.predicted);
    CHECK(std::abs(peak.predicted / peak.measured - 1) <= (std::string(remat) == "always" ? 0.15 : 0.10));
  }
}

TEST_CASE("zb-h1 holds at most 1.15x 1F1B's peak activation memory on the quickstart's GPT (K = 2, M = 4), the plan within 10% of it") {
  if (world().size() != 4) return;
  // D = 2 x K = 2, micro-batches of 4 sequences of 64: the quickstart's per rank. The last
  // stage's head (256 words: its W 3% of the stage's backward), final LayerNorm and loss
  // compute their weight gradients in B and give their memory back there, so its
  // W-pending micro-batch holds no logits or their gradient (1.18x while it did).
  double peak[2] = {0, 0}, largest[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    TrainConfig c = test::tiny_gpt({.layers = 4, .d_model = 128, .heads = 4, .seq_len = 64, .vocab = 256, .dropout = 0.0f,
                                    .batch_size = 32, .micro_batches = 4, .steps = 2, .seed = 1});
    c.threads = 1;
    c.pipeline.schedule = i == 0 ? "1f1b" : "zb-h1";
    c.pipeline.grid = GridShape{.stages = 2, .replicas = 2};
    const PeakMemory p = peak_memory(c);
    peak[i] = p.measured;
    CAPTURE(c.pipeline.schedule);
    CAPTURE(p.stage);
    CAPTURE(p.measured);
    CAPTURE(p.predicted);
    CHECK(std::abs(p.predicted / p.measured - 1) <= 0.10);
    largest[i] = peak[i];
    world().allreduce(std::span<double>(&largest[i], 1), Reduce::max);
  }
  CAPTURE(largest[0]);
  CAPTURE(largest[1]);
  CHECK(largest[1] <= 1.15 * largest[0]);
}

TEST_CASE("plan's activation memory per rank is the measured peak within 10% on the convolutional stage, 15% on the head's (ResNet-18, gpipe: never, selective, always)") {
  if (world().size() != 4) return;
  // D = 2 x K = 2: stage 0 the stem and the first residual stages' convolutions (their
  // im2col columns held per micro-batch, the backward's and the residual blocks' input
  // gradients as scratch), stage 1 the rest, the pool and the head.
  for (const char* remat : {"never", "selective", "always"}) {
    TrainConfig c = resnet18(8, 16, 16, 2);
    c.pipeline.grid.replicas = 2;
    c.pipeline.remat = remat;
    const PeakMemory peak = peak_memory(c);
    CAPTURE(remat);
    CAPTURE(peak.stage);
    CAPTURE(peak.measured);
    CAPTURE(peak.predicted);
    // The last stage is small (here 0.3 MiB) and has parts the plan leaves out (the
    // loss's and the pool's few bytes): 12% under at this size.
    CHECK(std::abs(peak.predicted / peak.measured - 1) <= (peak.stage == 0 ? 0.10 : 0.15));
  }
}

TEST_CASE("--remat auto: each stage takes the first of never, selective, selective with some micro-batches rematerialized, always that fits --memory-per-rank (the last stage never, always), bitwise never's training") {
  if (world().size() != 4) return;
  auto config = [](const char* remat, double limit) {
    TrainConfig c = test::tiny_gpt({.layers = 4, .d_model = 64, .heads = 4, .seq_len = 64, .vocab = 64, .dropout = 0.1f,
                                    .batch_size = 16, .micro_batches = 8, .steps = 3, .seed = 5});
    c.threads = 1;
    c.pipeline.remat = remat;
    if (limit > 0) c.pipeline.memory_per_rank = cat(static_cast<long long>(limit));
    return c;
  };
  const RunResult reference = run(config("never", 0), 4);
  const Plan never = plan_run(config("never", 0), world());
  const auto need = [&](int stage, Remat mode) {
    return never.weight_bytes(stage) + never.activation_bytes(stage, stage, mode) + never.input_bytes(stage, stage, mode);
  };
  // Limits between stage 0's never and selective needs (it takes selective), and between
  // its selective and always needs (it rematerializes some micro-batches wholly).
  for (const bool tight : {false, true}) {
    CAPTURE(tight);
    const double limit = tight ? (need(0, Remat::selective) + need(0, Remat::always)) / 2
                               : (need(0, Remat::never) + need(0, Remat::selective)) / 2;
    const Plan plan = plan_run(config("auto", limit), world());
    REQUIRE(plan.stage_remat.size() == 4);
    CHECK(plan.stage_remat[0] == Remat::selective);
    CHECK((plan.remat_whole[0] > 0) == tight);
    for (int stage = 0; stage < 4; ++stage) {
      CAPTURE(stage);
      const Remat chosen = plan.stage_remat[static_cast<std::size_t>(stage)];
      const int whole = plan.remat_whole[static_cast<std::size_t>(stage)];
      CAPTURE(whole);
      // It fits, and the cheaper choices before it did not: pure selective before a mixed
      // one, and the mixed one with a micro-batch fewer rematerialized.
      if (chosen != Remat::always)
        CHECK(plan.weight_bytes(stage) + plan.activation_bytes(stage) + plan.input_bytes(stage, stage, chosen) <= limit);
      if (chosen != Remat::never) CHECK(need(stage, Remat::never) > limit);
      // The model's last stage takes always next: its forwards wait for their backwards,
      // recomputing nothing (the schedule runs F then B of each micro-batch there).
      if (stage == 3) {
        CHECK((chosen == Remat::always) == (need(stage, Remat::never) > limit));
        if (chosen == Remat::always) {
          CHECK(plan.remat_free(stage));
          CHECK(plan.deferred_from(stage) == 0);
          const std::vector<Action>& list = plan.schedule.actions[3];
          for (std::size_t i = 0; i < list.size(); ++i)
            if (list[i].kind == ActionKind::forward)
              CHECK((i + 1 < list.size() && list[i + 1].kind == ActionKind::backward &&
                     list[i + 1].micro_batch == list[i].micro_batch));
        }
      } else if (whole > 0 || chosen == Remat::always) {
        CHECK(need(stage, Remat::selective) > limit);
      }
      if (whole > 1) {
        Plan fewer = plan;
        fewer.remat_whole[static_cast<std::size_t>(stage)] = whole - 1;
        CHECK(fewer.weight_bytes(stage) + fewer.activation_bytes(stage) + fewer.input_bytes(stage, stage, chosen) > limit);
      }
    }
    const RunResult r = run(config("auto", limit), 4);
    if (world().rank() == 0) {
      CHECK(r.losses == reference.losses);
      CHECK(r.norms == reference.norms);
      CHECK(std::memcmp(r.params.data(), reference.params.data(), r.params.size() * sizeof(float)) == 0);
    }
    // What each rank measures stays within the plan's activations (as the plan's accuracy
    // test bounds them), so the chosen stages fit.
    Executor exec(plan, world());
    exec.connect();
    exec.allocate();
    for (int step = 0; step < 2; ++step) exec.step(step);
    const int stage = exec.grid().stage();
    CAPTURE(stage);
    CHECK(static_cast<double>(exec.peak_activation_bytes()) <= 1.15 * plan.activation_bytes(stage));
  }
}
