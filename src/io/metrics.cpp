// The run's numbers as JSON: metrics lines per step and evaluation, and the summary.
#include "mpipe/io/metrics.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "mpipe/io/json.hpp"

namespace mpipe {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "w");
  MPIPE_REQUIRE(file_, "check that the directory exists and is writable",
                "cannot write metrics file '", path, "': ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::check(int printed) {
  // A full disk shows at the flush (or the print): an error, never a silent short file.
  if (printed < 0 || std::fflush(file_) != 0)
    throw UserError(cat("cannot write metrics file '", path_, "': ", std::strerror(errno)),
                    "free space there, or give --metrics a file on another file system");
}

void MetricsWriter::write_line(const std::string& json) { check(std::fprintf(file_, "%s\n", json.c_str())); }

void MetricsWriter::write(const StepResult& r, double samples_per_s, double tokens_per_s) {
  // A skipped step's non-finite numbers become null.
  const Json line = {{"step", r.step + 1},
                     {"loss", json_number(static_cast<float>(r.loss))},
                     {"lr", json_number(r.lr)},
                     {"grad_norm", json_number(r.grad_norm)},
                     {"skipped", r.skipped},
                     {"step_time_s", json_number(r.seconds)},
                     {"samples_per_s", json_number(samples_per_s)},
                     {"tokens_per_s", json_number(tokens_per_s)},
                     {"bubble_fraction", json_number(r.bubble_fraction)}};
  write_line(line.dump());
}

void MetricsWriter::write_eval(std::int64_t step, const EvalResult& e) {
  // A diverged model's loss is null, as in write().
  Json line = {{"step", step + 1},
                     {"eval_loss", json_number(e.loss, 17)},
                     {"eval_accuracy", json_number(e.accuracy, 17)},
                     {"eval_samples", e.samples}};
  if (e.available > 0) line["eval_samples_in_file"] = e.available;
  write_line(line.dump());
}

std::string summary_json(const Executor& exec, const RunSummary& s) {
  const RunOptions& c = exec.options();
  const Grid& g = exec.grid();
  Json per_rank = Json::array();
  std::vector<double> stage_peak(static_cast<std::size_t>(g.stages()), 0.0);
  for (std::size_t r = 0; r < s.peak_bytes_per_rank.size(); ++r) {
    per_rank.push_back(static_cast<long long>(s.peak_bytes_per_rank[r]));
    double& peak = stage_peak[static_cast<std::size_t>(g.shape().stage_of(static_cast<int>(r)))];
    peak = std::max(peak, s.peak_bytes_per_rank[r]);
  }
  Json device_per_rank = Json::array();  // empty on the CPU
  for (const double bytes : s.device_peak_bytes_per_rank) device_per_rank.push_back(static_cast<long long>(bytes));
  Json per_stage = Json::array();
  for (const double peak : stage_peak) per_stage.push_back(static_cast<long long>(peak));
  // "phase_s": per stage, each phase's [min, mean, max] seconds per step.
  Json phases = Json::array();
  for (std::size_t st = 0; st < s.phases.size(); ++st) {
    Json stage = {{"stage", st}};
    for (int i = 0; i < PhaseTimes::count; ++i) {
      std::string key = PhaseTimes::name(i);
      std::replace(key.begin(), key.end(), ' ', '_');
      stage[key] = {json_number(s.phases[st].min[i], 6), json_number(s.phases[st].avg[i], 6),
                    json_number(s.phases[st].max[i], 6)};
    }
    phases.push_back(stage);
  }
  const auto seconds = [](const std::vector<double>& values) {
    Json out = Json::array();
    for (const double v : values) out.push_back(json_number(v, 4));
    return out;
  };
  const Json summary = {{"summary", true},
                        {"model", c.model.kind},
                        {"stages", g.stages()},
                        {"replicas", g.replicas()},
                        {"micro_batches", c.micro_batches},
                        {"batch_size", c.batch_size},
                        {"schedule", c.schedule},
                        {"virtual_stages", c.virtual_stages},
                        {"remat", to_string(c.remat)},
                        {"overlap_steps", c.overlap_steps},
                        {"shard_optimizer", c.shard_optimizer},
                        {"updates_ahead", exec.speculated()},
                        {"updates_undone", exec.rolled_back()},
                        {"steps_timed", s.steps},
                        {"step_time_s", json_number(s.median_step_s)},
                        {"samples_per_s", json_number(s.samples_per_s)},
                        {"tokens_per_s", json_number(s.tokens_per_s)},
                        {"bubble_fraction", json_number(s.bubble)},
                        {"theoretical_bubble", json_number(s.theoretical_bubble)},
                        {"simulated_bubble", json_number(s.simulated_bubble)},
                        {"peak_activation_bytes_per_stage", per_stage},
                        {"peak_activation_bytes_per_rank", per_rank},
                        {"peak_device_bytes_per_rank", device_per_rank},
                        {"cpu_s_per_rank", seconds(s.cpu_s_per_rank)},
                        {"progress_thread_cpu_s_per_rank", seconds(s.progress_thread_cpu_s_per_rank)},
                        {"sent_bytes_per_rank", s.sent_bytes_per_rank},
                        {"skip_bytes_per_rank", s.skip_bytes_per_rank},
                        {"phase_s", phases}};
  return summary.dump();
}

void write_summary(const std::string& path, const std::string& json) {
  std::FILE* out = std::fopen(path.c_str(), "w");
  if (out) std::fprintf(out, "%s\n", json.c_str());
  close_output(out, path, "summary", "--summary");
}

}  // namespace mpipe
