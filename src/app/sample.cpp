// --sample-every: the first replica's weights gathered on rank 0, and a continuation of
// the prompt from them (nn/decoder.hpp), for the log.
#include "mpipe/app/sample.hpp"

#include <cstdio>
#include <cstring>
#include <limits>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe {

namespace {

// One entry's values in the gathered bytes: what follows is `count` floats.
struct Packed {
  std::int32_t layer, index;
  std::int64_t count;
};

}  // namespace

std::string sampling_hint(const std::string& problem) {
  return problem.starts_with("--sample-prompt") ? "give --sample-prompt one byte or more of the model's vocabulary "
                                                  "(default: a newline)"
                                                : "sample a GPT's training, or leave --sample-every out";
}

std::string sampling_problem(const TrainConfig& config, const Model& model) {
  if (std::string problem = generation_problem(model); !problem.empty()) return problem;
  for (const char c : config.sample_prompt)
    if (static_cast<unsigned char>(c) >= model.classes())
      return cat("--sample-prompt byte ", static_cast<int>(static_cast<unsigned char>(c)), " is not below the vocabulary's ",
                 model.classes());
  // The weights reach rank 0 in one gather, whose counts are ints.
  if (static_cast<double>(model.parameter_count()) * sizeof(float) > 0.9 * std::numeric_limits<int>::max())
    return cat("rank 0 gathers the weights in one message of at most 2 GiB, and this model's are ",
               static_cast<double>(model.parameter_count()) * sizeof(float) / (1 << 30), " GiB");
  return config.sample_prompt.empty() ? "--sample-prompt is empty" : "";
}

std::string quoted_tokens(const std::vector<std::int32_t>& tokens, std::int64_t vocab) {
  std::string out;
  if (vocab > 256) {
    for (const std::int32_t t : tokens) out += cat(out.empty() ? "" : " ", t);
    return out;
  }
  out = "\"";
  for (const std::int32_t t : tokens) {
    if (t == '\n') out += "\\n";
    else if (t == '\t') out += "\\t";
    else if (t == '\\' || t == '"') out += cat("\\", static_cast<char>(t));
    else if (t >= 32 && t < 127) out += static_cast<char>(t);
    else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned>(t));
      out += hex;
    }
  }
  return out + "\"";
}

std::string TrainingSample::operator()(Executor& exec, std::int64_t step) {
  const Communicator& world = exec.grid().world();
  ParamStore& params = exec.params();
  packed_.clear();
  if (exec.grid().replica() == 0) {
    params.download();  // a GPU's values to the host mirror
    for (const ParamEntry& e : params.entries()) {
      if (e.alias || e.tied_copy) continue;  // the owner's values come with the owner
      const Packed head{e.layer, e.index, e.numel()};
      const auto* bytes = reinterpret_cast<const std::byte*>(&head);
      packed_.insert(packed_.end(), bytes, bytes + sizeof head);
      const auto* values = reinterpret_cast<const std::byte*>(params.params().data() + e.param_offset);
      packed_.insert(packed_.end(), values, values + e.numel() * sizeof(float));
    }
  }
  const std::vector<std::byte> all = world.gather(std::span<const std::byte>(packed_), 0, nullptr);
  // The others wait here for rank 0's sample, not in the next step's messages, whose waits
  // time out (--p2p-timeout) and whose times would count it.
  if (world.rank() != 0) {
    world.barrier();
    return "";
  }
  const std::string line = continuation(exec, all, step);
  world.barrier();
  return line;
}

std::string TrainingSample::continuation(const Executor& exec, const std::vector<std::byte>& all, std::int64_t step) {
  if (!model_) {
    model_ = std::make_unique<Model>(exec.model().config(), exec.model().spec());
    store_ = std::make_unique<ParamStore>(*model_, 0, model_->size(), 0);
    decoder_ = std::make_unique<Decoder>(*model_, 0, model_->size(), 1, Device::cpu, DType::f32);
  }
  std::size_t filled = 0, owners = 0;
  for (const ParamEntry& e : store_->entries()) owners += e.alias ? 0 : 1;
  for (std::size_t at = 0; at < all.size();) {
    Packed head;
    std::memcpy(&head, all.data() + at, sizeof head);
    at += sizeof head;
    for (const ParamEntry& e : store_->entries())
      if (!e.alias && e.layer == head.layer && e.index == head.index && e.numel() == head.count) {
        std::memcpy(store_->params().data() + e.param_offset, all.data() + at, static_cast<std::size_t>(head.count) * sizeof(float));
        ++filled;
      }
    at += static_cast<std::size_t>(head.count) * sizeof(float);
  }
  MPIPE_CHECK(filled == owners, "--sample-every: ", filled, " of the model's ", owners, " parameters gathered");
  // The prompt, then a token at a time (the window slides past the context, as generate's).
  std::vector<std::int32_t> tokens;
  for (const char c : config_.sample_prompt) tokens.push_back(static_cast<unsigned char>(c));
  const std::size_t prompt = tokens.size();
  const Sampling sampling{0.8, 40, 1.0};
  const int threads = cpu::threads();
  cpu::set_threads(1);
  for (int i = 0; i < config_.sample_tokens; ++i) {
    const auto [count, position] = decoder_->next_feed(0, static_cast<std::int64_t>(tokens.size()), i == 0);
    const Tensor x = decoder_->input(count);
    std::copy_n(tokens.end() - count, count, x.i32());
    const Tensor logits = decoder_->forward(0, x, position);
    tokens.push_back(sample_token(logits.span(), sampling, sampling_uniform(config_.seed + static_cast<std::uint64_t>(step), 0, i),
                                  order_, weights_));
  }
  cpu::set_threads(threads);
  return cat("sample at step ", step + 1, ": ", quoted_tokens({tokens.begin() + static_cast<std::ptrdiff_t>(prompt), tokens.end()},
                                                             model_->classes()));
}

}  // namespace mpipe
