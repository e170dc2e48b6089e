// Metrics: one JSON object per step (JSON lines), floats printed with 9 significant
// digits so float32 values round-trip.
#pragma once
#include <cstdio>
#include <string>

#include "mpipe/pipeline/executor.hpp"

namespace mpipe {

class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path);  // UserError if it cannot be opened
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  // Each throws UserError when the line cannot be written (a full disk).
  void write(const StepResult& r, double samples_per_s, double tokens_per_s);
  // An evaluation after step `step` (0-based, as StepResult::step).
  void write_eval(std::int64_t step, const EvalResult& e);
  void write_line(const std::string& json);

 private:
  void check(int printed);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace mpipe
