// Options files: read with a real TOML parser (toml++, header-only here) so that a
// broken file is one clear line naming where it breaks; written from a TrainConfig.
#include "mpipe/app/config_file.hpp"

#include <filesystem>
#include <string>

#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 1
#include <toml++/toml.h>

#include "mpipe/core/error.hpp"
#include "mpipe/pipeline/schedule/schedule.hpp"

namespace mpipe {

namespace {

std::string where(const std::string& path, const toml::source_region& at) {
  return cat("config file '", path, "' line ", at.begin.line, ", column ", at.begin.column);
}

// A TOML value as the text CLI11 converts, or nothing for what no option takes.
std::optional<std::string> as_text(const toml::node& value) {
  if (const auto* s = value.as_string()) return s->get();
  if (const auto* i = value.as_integer()) return std::to_string(i->get());
  if (const auto* b = value.as_boolean()) return std::string(b->get() ? "true" : "false");
  if (const auto* f = value.as_floating_point()) return shortest_text(f->get());
  return std::nullopt;
}

}  // namespace

void apply_config_file(CLI::App& command) {
  const CLI::Option* config = command.get_option("--config");
  if (config->count() == 0) return;
  const std::string path = config->as<std::string>();
  namespace fs = std::filesystem;
  std::error_code ec;
  // Never open what could block (a FIFO with no writer) or what is no file at all.
  MPIPE_REQUIRE(fs::exists(path, ec), "give the path of a TOML file", "config file '", path, "' does not exist");
  MPIPE_REQUIRE(fs::is_regular_file(path, ec), "give the path of a TOML file",
                "config file '", path, "' is not a regular file");
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw UserError(cat(where(path, e.source()), ": ", printable_line(std::string(e.description()))),
                    "check the TOML syntax (key = value, one per line)");
  }
  for (const auto& [key, value] : table) {
    const std::string name(key.str());
    const std::string at = where(path, key.source());
    MPIPE_REQUIRE(!value.is_table() && !value.is_array_of_tables(), "put every option at the top level of the file",
                  at, ": sections are not supported ([", name, "])");
    CLI::Option* option = command.get_option_no_throw("--" + name);
    MPIPE_REQUIRE(option && name != "config", cat("see 'mpipe ", command.get_name(), " --help' for the names"), at,
                  ": unknown option '", name, "'");
    const std::optional<std::string> text = as_text(value);
    MPIPE_REQUIRE(text.has_value(), "give a string, a number or true/false", at, ": ", name,
                  ": lists, dates and times are not option values");
    if (option->count() > 0) continue;  // the command line wins
    option->add_result(*text);
    try {
      option->run_callback();
    } catch (const CLI::ParseError& e) {
      throw UserError(cat(at, ": ", name, ": ", e.what()), "check the value's type");
    }
  }
}

std::string to_toml(const TrainConfig& c) {
  const auto& m = c.model;
  const auto& p = c.optimizer;
  const auto& q = c.pipeline;
  std::string o;
  auto line = [&](const char* key, const std::string& value) { o += cat(key, " = ", value, "\n"); };
  line("model", toml_quoted(m.kind));
  if (is_preset(m.kind)) line("layers", cat(m.layers));  // a model file has its own sizes
  if (m.kind == "gpt" || m.kind == "llama") {
    line("d-model", cat(m.d_model));
    line("heads", cat(m.heads));
    line("seq-len", cat(m.seq_len));
    line("vocab", cat(m.vocab));
    line("head-chunks", cat(m.head_chunks));
    line("head-logits", toml_quoted(m.head_logits));
  }
  if (m.kind == "llama") {
    line("kv-heads", cat(m.kv_heads));
    line("ffn", cat(m.ffn));
    line("rope-theta", toml_float(m.rope_theta));
    line("norm-eps", toml_float(m.norm_eps));
    line("tie-embeddings", toml_quoted(m.tie_embeddings));
  } else if (m.kind == "mlp") {
    line("hidden", cat(m.hidden));
    line("inputs", cat(m.inputs));
    line("classes", cat(m.classes));
  } else if (m.kind == "resnet") {
    line("image", cat(m.image));
    line("channels", cat(m.channels));
    line("width", cat(m.width));
    line("classes", cat(m.classes));
  }
  if (is_preset(m.kind)) line("dropout", toml_float(m.dropout));
  line("data", toml_quoted(c.data));
  line("data-packing", toml_quoted(c.data_packing));
  if (c.eot_id >= 0) line("eot-id", cat(c.eot_id));
  if (!c.tokenizer.empty()) line("tokenizer", toml_quoted(c.tokenizer));
  line("prefetch", toml_quoted(c.prefetch));
  line("batch-size", cat(c.batch_size));
  line("micro-batches", cat(c.micro_batches));
  line("steps", cat(c.steps));
  line("seed", cat(c.seed));
  line("device", toml_quoted(c.device));
  line("precision", toml_quoted(c.precision));
  line("cuda-graphs", toml_quoted(c.cuda_graphs));
  line("channels-last", toml_quoted(c.channels_last));
  line("threads", cat(c.threads));
  line("optimizer", toml_quoted(p.kind));
  line("lr", toml_float(p.lr));
  line("lr-schedule", toml_quoted(p.lr_schedule));
  line("lr-decay-steps", cat(p.lr_decay_steps));
  line("min-lr-ratio", toml_float(p.min_lr_ratio));
  line("wsd-decay", toml_float(p.wsd_decay));
  line("warmup", cat(p.warmup));
  line("weight-decay", toml_float(p.weight_decay));
  line("momentum", toml_float(p.momentum));
  line("clip-grad", toml_float(p.clip_grad));
  line("stages", cat(q.grid.stages));
  line("replicas", cat(q.grid.replicas));
  line("rank-order", toml_quoted(q.grid.rank_order));
  line("schedule", toml_quoted(q.schedule));
  line("virtual-stages", cat(q.virtual_stages));
  line("remat", toml_quoted(q.remat));
  if (!q.memory_per_rank.empty()) line("memory-per-rank", toml_quoted(q.memory_per_rank));
  line("batchnorm", toml_quoted(q.batchnorm));
  line("partition", toml_quoted(q.partition));
  if (!q.balance.empty()) line("balance", toml_quoted(q.balance));
  line("p2p-timeout", toml_float(q.p2p_timeout));
  line("comm-progress", toml_quoted(q.comm_progress));
  line("comm-poll-us", toml_float(q.comm_poll_us));
  line("comm-wait", toml_quoted(q.comm_wait));
  line("in-flight", q.in_flight == in_flight_of_1f1b ? toml_quoted("1f1b") : cat(q.in_flight));
  line("overlap-steps", q.overlap_steps ? "true" : "false");
  line("shard-optimizer", q.shard_optimizer ? "true" : "false");
  line("log-every", cat(c.log_every));
  if (!c.checkpoint_dir.empty()) line("checkpoint-dir", toml_quoted(c.checkpoint_dir));
  line("checkpoint-every", cat(c.checkpoint_every));
  line("checkpoint-async", toml_quoted(c.checkpoint_async));
  line("keep", cat(c.keep));
  if (!c.time_limit.empty()) line("time-limit", toml_quoted(c.time_limit));
  if (!c.init_from.empty()) line("init-from", toml_quoted(c.init_from));
  return o;
}

}  // namespace mpipe
