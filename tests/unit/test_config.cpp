// Command-line and TOML configuration: names, precedence, and user errors (exit code 2).
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "mpipe/app/cli.hpp"
#include "mpipe/app/config.hpp"
#include "mpipe/app/config_file.hpp"
#include "mpipe/app/process.hpp"
#include "temp_dir.hpp"

using namespace mpipe;
namespace fs = std::filesystem;

namespace {

TrainConfig parse(std::vector<std::string> args) {
  CLI::App app;
  TrainConfig config;
  CLI::App* train = app.add_subcommand("train");
  add_train_options(*train, config);
  args.insert(args.begin(), "train");
  std::reverse(args.begin(), args.end());  // CLI11 takes a reversed vector
  app.parse(args);
  apply_config_file(*train);
  return config;
}

int run(std::vector<std::string> args) {
  args.insert(args.begin(), "mpipe");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return run_main(static_cast<int>(argv.size()), argv.data());
}

fs::path write_toml(const std::string& text) {
  // One name per process: ctest runs these test cases in parallel processes.
  static int count = 0;
  const fs::path path = mpipe::testing::test_file("config-" + std::to_string(count++) + ".toml");
  std::ofstream(path) << text;
  return path;
}

}  // namespace

TEST_CASE("every documented option parses into the config") {
  const TrainConfig c = parse({"--model", "mlp", "--layers", "3", "--d-model", "64", "--heads", "8",
                               "--seq-len", "32", "--vocab", "500", "--hidden", "128", "--inputs", "20",
                               "--classes", "5", "--dropout", "0.25", "--data", "text:x", "--batch-size", "48",
                               "--micro-batches", "6", "--optimizer", "sgd", "--lr", "0.5", "--weight-decay",
                               "0.01", "--momentum", "0.8", "--warmup", "7", "--clip-grad", "2", "--steps", "9",
                               "--seed", "11", "--threads", "2", "--log-every", "3", "--metrics", "m.jsonl"});
  CHECK(c.model.kind == "mlp");
  CHECK(c.model.layers == 3);
  CHECK(c.model.d_model == 64);
  CHECK(c.model.heads == 8);
  CHECK(c.model.seq_len == 32);
  CHECK(c.model.vocab == 500);
  CHECK(c.model.hidden == 128);
  CHECK(c.model.inputs == 20);
  CHECK(c.model.classes == 5);
  CHECK(c.model.dropout == 0.25f);
  CHECK(c.data == "text:x");
  CHECK(c.batch_size == 48);
  CHECK(c.micro_batches == 6);
  CHECK(c.optimizer.kind == "sgd");
  CHECK(c.optimizer.lr == 0.5f);
  CHECK(c.optimizer.weight_decay == 0.01f);
  CHECK(c.optimizer.momentum == 0.8f);
  CHECK(c.optimizer.warmup == 7);
  CHECK(c.optimizer.clip_grad == 2.0f);
  CHECK(c.steps == 9);
  CHECK(c.seed == 11);
  CHECK(c.threads == 2);
  CHECK(c.log_every == 3);
  CHECK(c.metrics == "m.jsonl");
}

TEST_CASE("pipeline options parse into the config") {
  const TrainConfig c = parse({"--stages", "4", "--replicas", "2", "--rank-order", "data", "--schedule", "1f1b",
                               "--remat", "except-last", "--partition", "time", "--balance", "1,2,3", "--p2p-timeout",
                               "30"});
  CHECK(c.pipeline.grid.stages == 4);
  CHECK(c.pipeline.grid.replicas == 2);
  CHECK(c.pipeline.grid.rank_order == "data");
  CHECK(c.pipeline.schedule == "1f1b");
  CHECK(c.pipeline.remat == "except-last");
  CHECK(c.pipeline.partition == "time");
  CHECK(c.pipeline.balance == "1,2,3");
  CHECK(c.pipeline.p2p_timeout == 30.0);
}

TEST_CASE("a TOML config sets options and the command line overrides it") {
  const fs::path path = write_toml("# comment\nmodel = \"gpt\"\nlayers = 6\nd-model = 96\nlr = 0.002\nsteps = 40\n");
  const TrainConfig c = parse({"--config", path.string(), "--steps", "5"});
  CHECK(c.model.layers == 6);
  CHECK(c.model.d_model == 96);
  CHECK(c.optimizer.lr == 0.002f);
  CHECK(c.steps == 5);  // command line wins
  fs::remove(path);
}

TEST_CASE("a value of the wrong type in the config file is an error") {
  const fs::path path = write_toml("layers = \"many\"\n");
  CHECK_THROWS_AS(parse({"--config", path.string()}), UserError);
  CHECK(run({"train", "--config", path.string()}) == 2);
  fs::remove(path);
}

TEST_CASE("an unknown key in the config file is an error") {
  const fs::path path = write_toml("layers = 2\nlayres = 3\n");
  CHECK_THROWS_AS(parse({"--config", path.string()}), UserError);
  CHECK(run({"train", "--config", path.string()}) == 2);
  fs::remove(path);
}

TEST_CASE("bad input exits with code 2 before any training") {
  CHECK(run({"train", "--no-such-option"}) == 2);
  CHECK(run({"train", "--layers", "0"}) == 2);
  CHECK(run({"train", "--layers", "-1"}) == 2);
  CHECK(run({"train", "--d-model", "30", "--heads", "4"}) == 2);
  CHECK(run({"train", "--batch-size", "10", "--micro-batches", "3"}) == 2);
  CHECK(run({"train", "--batch-size", "0"}) == 2);
  CHECK(run({"train", "--model", "rnn"}) == 2);
  CHECK(run({"train", "--optimizer", "lamb"}) == 2);
  CHECK(run({"train", "--lr", "-1"}) == 2);
  CHECK(run({"train", "--dropout", "1.5"}) == 2);
  CHECK(run({"train", "--steps", "abc"}) == 2);
  CHECK(run({"train", "--data", "text:/no/such/file"}) == 2);
  CHECK(run({"train", "--config", "/no/such/config.toml"}) == 2);
  CHECK(run({}) == 2);
}

TEST_CASE("validation names the option at fault") {
  TrainConfig c;
  c.model.d_model = 30;
  c.model.heads = 4;
  try {
    validate(c);
    FAIL("no error");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("--d-model 30 is not divisible by --heads 4") != std::string::npos);
    CHECK(!e.hint().empty());
  }
}

TEST_CASE("--memory-per-rank: bytes or a size with its unit, --remat auto needs it") {
  CHECK(parse_memory_size("123") == 123);
  CHECK(parse_memory_size("500MB") == 500e6);
  CHECK(parse_memory_size("8GiB") == 8.0 * 1024 * 1024 * 1024);
  CHECK(parse_memory_size("1.5KiB") == 1536);
  CHECK(parse_memory_size("2TB") == 2e12);
  for (const char* bad : {"", "abc", "3XB", "-1GiB", "0", "nan", "8 GiB"})
    CHECK_THROWS_AS(parse_memory_size(bad), UserError);
  TrainConfig c;
  c.pipeline.remat = "auto";
  CHECK_THROWS_WITH_AS(validate(c), doctest::Contains("--remat auto needs --memory-per-rank"), UserError);
  c.pipeline.memory_per_rank = "8GiB";
  CHECK_NOTHROW(validate(c));
  CHECK(run_options(c).memory_per_rank == 8.0 * 1024 * 1024 * 1024);
  CHECK(run_options(c).remat == Remat::automatic);
}
