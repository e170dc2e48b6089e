// --sample-every: a short continuation of a prompt in the training log, so that a user
// sees what the model learns while it trains (llm.c samples as it trains).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpipe/app/config.hpp"
#include "mpipe/nn/decoder.hpp"
#include "mpipe/nn/params.hpp"

namespace mpipe {

class Executor;

// Why the run's model cannot be sampled with --sample-every (a prompt byte past its
// vocabulary included); empty when it can.
std::string sampling_problem(const TrainConfig& config, const Model& model);
// The hint for a problem of sampling_problem's: the prompt's, or the model's.
std::string sampling_hint(const std::string& problem);

// Tokens as a log line: the bytes of a vocabulary of bytes, quoted, with \n, \t, \\, \"
// and \xNN for the rest; else the ids.
std::string quoted_tokens(const std::vector<std::int32_t>& tokens, std::int64_t vocab);

class TrainingSample {
 public:
  explicit TrainingSample(const TrainConfig& config) : config_(config) {}
  // Collective over the world: the first replica's weights to rank 0, which continues
  // --sample-prompt by --sample-tokens (temperature 0.8, the 40 most likely; the draws'
  // seed the run's and the step's) on its CPU, one thread, and returns the log line;
  // empty on the other ranks. Rank 0 then holds a copy of the whole model's weights.
  std::string operator()(Executor& exec, std::int64_t step);

 private:
  // Rank 0: the gathered weights into its copy of the model, and the continuation's line.
  std::string continuation(const Executor& exec, const std::vector<std::byte>& all, std::int64_t step);

  const TrainConfig& config_;
  std::unique_ptr<Model> model_;  // rank 0's copy: its own layers, bound to store_
  std::unique_ptr<ParamStore> store_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<std::byte> packed_;
  std::vector<std::int32_t> order_;
  std::vector<double> weights_;
};

}  // namespace mpipe
