// Command-line parsing, the error policy (one line, exit 2 for user errors) and the
// train command's report.
#include "mpipe/app/commands.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>

#include <cstdio>
#include <iostream>
#include <memory>

#include "mpipe/core/version.hpp"
#include "mpipe/io/metrics.hpp"

namespace mpipe {

namespace {
constexpr int exit_user_error = 2;

// The cores this process may run on (what the launcher or Slurm gave it).
int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
}
constexpr int exit_internal_error = 1;
}  // namespace

void add_train_options(CLI::App& cmd, TrainConfig& c) {
  cmd.add_option("--config", "TOML file with any of these options (command-line values win)")
      ->check(CLI::ExistingFile);
  auto& m = c.model;
  auto& o = c.optimizer;
  cmd.add_option("--model", m.kind, "Model: gpt or mlp")->capture_default_str();
  cmd.add_option("--layers", m.layers, "Transformer blocks (gpt) or hidden blocks (mlp)")->capture_default_str();
  cmd.add_option("--d-model", m.d_model, "Channels of the residual stream (gpt)")->capture_default_str();
  cmd.add_option("--heads", m.heads, "Attention heads (gpt)")->capture_default_str();
  cmd.add_option("--seq-len", m.seq_len, "Tokens per sample (gpt)")->capture_default_str();
  cmd.add_option("--vocab", m.vocab, "Vocabulary size (gpt)")->capture_default_str();
  cmd.add_option("--hidden", m.hidden, "Width of the hidden layers (mlp)")->capture_default_str();
  cmd.add_option("--inputs", m.inputs, "Input features (mlp)")->capture_default_str();
  cmd.add_option("--classes", m.classes, "Output classes (mlp)")->capture_default_str();
  cmd.add_option("--dropout", m.dropout, "Dropout probability")->capture_default_str();
  cmd.add_option("--data", c.data, "synthetic, text:PATH (bytes) or tokens:PATH (uint16)")->capture_default_str();
  cmd.add_option("--batch-size", c.batch_size, "Global mini-batch, in samples")->capture_default_str();
  cmd.add_option("--micro-batches", c.micro_batches, "Micro-batches per mini-batch")->capture_default_str();
  cmd.add_option("--optimizer", o.kind, "adamw or sgd")->capture_default_str();
  cmd.add_option("--lr", o.lr, "Peak learning rate")->capture_default_str();
  cmd.add_option("--min-lr-ratio", o.min_lr_ratio, "Cosine decay ends at lr times this")->capture_default_str();
  cmd.add_option("--weight-decay", o.weight_decay, "Decoupled weight decay (matrices only)")->capture_default_str();
  cmd.add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
  cmd.add_option("--warmup", o.warmup, "Steps of linear learning-rate warm-up")->capture_default_str();
  cmd.add_option("--clip-grad", o.clip_grad, "Clip the global gradient norm to this (0: off)")->capture_default_str();
  cmd.add_option("--steps", c.steps, "Train up to this step")->capture_default_str();
  cmd.add_option("--seed", c.seed, "Seed of initialisation, data and dropout")->capture_default_str();
  cmd.add_option("--threads", c.threads, "Threads per process (BLAS and loops); 0: every core this process may use")
      ->capture_default_str();
  cmd.add_option("--log-every", c.log_every, "Print a line every N steps")->capture_default_str();
  cmd.add_option("--metrics", c.metrics, "Write one JSON object per step to FILE");
}

// CLI11 2.1 reads config files only for the top-level app, so a subcommand's file is
// applied here, the way CLI11 applies one: each key fills the option of the same name
// unless the command line already gave it. Unknown keys and sections are errors.
void apply_config_file(CLI::App& command) {
  const CLI::Option* config = command.get_option("--config");
  if (config->count() == 0) return;
  const std::string path = config->as<std::string>();
  std::vector<CLI::ConfigItem> items;
  try {
    items = CLI::ConfigTOML().from_file(path);
  } catch (const CLI::ParseError& e) {
    throw UserError(cat("cannot read config file '", path, "': ", e.what()), "check the TOML syntax");
  }
  for (const CLI::ConfigItem& item : items) {
    if (item.name == "++" || item.name == "--") continue;  // section markers
    MPIPE_REQUIRE(item.parents.empty(), "put every option at the top level of the file",
                  "config file '", path, "': sections are not supported ([", item.parents.front(), "])");
    CLI::Option* option = command.get_option_no_throw("--" + item.name);
    MPIPE_REQUIRE(option && item.name != "config", cat("see 'mpipe ", command.get_name(), " --help' for the names"),
                  "config file '", path, "': unknown option '", item.name, "'");
    if (option->count() > 0) continue;  // the command line wins
    option->add_result(item.inputs);
    try {
      option->run_callback();
    } catch (const CLI::ParseError& e) {
      throw UserError(cat("config file '", path, "': ", item.name, ": ", e.what()), "check the value's type");
    }
  }
}

int run_train(const TrainConfig& config) {
  validate(config);
  cpu::set_threads(config.threads > 0 ? config.threads : available_cores());
  std::unique_ptr<MetricsWriter> metrics;
  if (!config.metrics.empty()) metrics = std::make_unique<MetricsWriter>(config.metrics);
  Trainer trainer(config);

  const auto& m = config.model;
  std::printf("mpipe %s (%s): %s model, %d layers, %zu parameters, %d threads\n", version(), git_hash(),
              m.kind.c_str(), trainer.model().size(), trainer.params().count(), cpu::threads());
  std::printf("data: %s\n", trainer.dataset().describe().c_str());
  std::printf("batch %d = %d micro-batches of %d; %s, lr %g, %d steps\n", config.batch_size,
              config.micro_batches, config.batch_size / config.micro_batches, config.optimizer.kind.c_str(),
              config.optimizer.lr, config.steps);
  std::fflush(stdout);

  const int64_t tokens_per_sample = m.kind == "gpt" ? m.seq_len : 0;
  double total_seconds = 0.0;
  int64_t timed_steps = 0;
  for (int64_t step = 0; step < config.steps; ++step) {
    const StepResult r = trainer.step(step);
    const double samples_per_s = config.batch_size / r.seconds;
    const double tokens_per_s = samples_per_s * static_cast<double>(tokens_per_sample);
    if (step > 0) {  // the first step sizes the arena and warms caches
      total_seconds += r.seconds;
      ++timed_steps;
    }
    if (metrics) metrics->write(r, samples_per_s, tokens_per_s);
    if (r.skipped)
      std::printf("step %lld: non-finite gradients (norm %g); update skipped\n", static_cast<long long>(step + 1), r.grad_norm);
    if ((step + 1) % config.log_every == 0 || step == 0 || step + 1 == config.steps) {
      std::printf("step %6lld/%d | loss %.6f | lr %.3e | grad norm %8.4f | %8.2f ms | ", static_cast<long long>(step + 1),
                  config.steps, r.loss, r.lr, r.grad_norm, r.seconds * 1e3);
      if (tokens_per_sample > 0) std::printf("%.0f tok/s\n", tokens_per_s);
      else std::printf("%.0f samples/s\n", samples_per_s);
      std::fflush(stdout);
    }
  }
  if (timed_steps > 0)
    std::printf("done: %lld steps, mean step %.2f ms (first step excluded), arena %.1f MiB\n",
                static_cast<long long>(config.steps), 1e3 * total_seconds / timed_steps,
                trainer.arena().capacity() / 1048576.0);
  return 0;
}

int run_main(int argc, char** argv) {
  CLI::App app{"mpipe: GPipe micro-batch pipeline-parallel training on MPI", "mpipe"};
  app.set_version_flag("--version", cat("mpipe ", version(), " (git ", git_hash(), ")"));
  app.require_subcommand(1);
  TrainConfig train_config;
  CLI::App* train = app.add_subcommand("train", "Train a model");
  add_train_options(*train, train_config);

  try {
    app.parse(argc, argv);
    if (train->parsed()) apply_config_file(*train);
  } catch (const UserError& e) {
    std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
    return exit_user_error;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "mpipe: error: %s; hint: see 'mpipe %s--help'\n", e.what(),
                 train->parsed() ? "train " : "");
    return exit_user_error;
  }

  try {
    if (train->parsed()) return run_train(train_config);
  } catch (const UserError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
    return exit_user_error;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "mpipe: internal error: %s\n", e.what());
    return exit_internal_error;
  }
  return 0;
}

}  // namespace mpipe
