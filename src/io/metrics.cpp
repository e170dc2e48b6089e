// JSON-lines metrics writer.
#include "mpipe/io/metrics.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <iomanip>

#include "mpipe/core/toml_text.hpp"

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
  // JSON has no NaN or Infinity: a skipped step's non-finite numbers become null.
  auto num = [](double v) { return std::isfinite(v) ? cat(std::setprecision(9), v) : std::string("null"); };
  check(std::fprintf(file_,
               "{\"step\": %lld, \"loss\": %s, \"lr\": %s, \"grad_norm\": %s, \"skipped\": %s, "
               "\"step_time_s\": %s, \"samples_per_s\": %s, \"tokens_per_s\": %s, \"bubble_fraction\": %s}\n",
               static_cast<long long>(r.step + 1), num(static_cast<float>(r.loss)).c_str(), num(r.lr).c_str(),
               num(r.grad_norm).c_str(), r.skipped ? "true" : "false", num(r.seconds).c_str(),
               num(samples_per_s).c_str(), num(tokens_per_s).c_str(), num(r.bubble_fraction).c_str()));
}

void MetricsWriter::write_eval(std::int64_t step, const EvalResult& e) {
  // As in write(): JSON has no NaN or Infinity (a diverged model's loss), null instead.
  auto num = [](double v) { return std::isfinite(v) ? shortest_text(v) : std::string("null"); };
  write_line(cat("{\"step\": ", step + 1, ", \"eval_loss\": ", num(e.loss), ", \"eval_accuracy\": ", num(e.accuracy),
                 ", \"eval_samples\": ", e.samples, "}"));
}

}  // namespace mpipe
