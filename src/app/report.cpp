// Sizes and counts as people read them, and the phase table of a run.
#include "mpipe/app/report.hpp"

#include <cmath>
#include <cstdio>

namespace mpipe {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char text[32];
  std::snprintf(text, sizeof text, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return text;
}

std::string fixed(double x, int digits) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", digits, x);
  return text;
}

std::string human_count(double n) {
  char text[32];
  if (n >= 1e9) std::snprintf(text, sizeof text, "%.2fG", n / 1e9);
  else if (n >= 1e6) std::snprintf(text, sizeof text, "%.2fM", n / 1e6);
  else if (n >= 1e3) std::snprintf(text, sizeof text, "%.1fk", n / 1e3);
  else std::snprintf(text, sizeof text, "%.0f", n);
  return text;
}


std::vector<StagePhases> phase_table(const PhaseStats& mine, const Communicator& world, const Schedule& schedule,
                                     int micro_batches, double theory, bool overlapped, double* simulated) {
  const int stages = schedule.stages, v = schedule.virtual_stages;
  const std::vector<PhaseStats> all = world.gather(mine, 0);
  if (world.rank() != 0 || mine.steps == 0) return {};
  std::vector<StagePhases> rows(static_cast<std::size_t>(stages));
  StageCosts measured = StageCosts::unit(schedule);
  std::printf("time per step in ms, min / avg / max over %g steps (the first excluded) and replicas\n", mine.steps);
  std::printf("%-6s", "stage");
  for (int i = 0; i < PhaseTimes::count; ++i) std::printf(" %20s", PhaseTimes::name(i));
  std::printf("\n");
  for (int s = 0; s < stages; ++s) {
    StagePhases& row = rows[static_cast<std::size_t>(s)];
    double count = 0;
    std::fill(std::begin(row.min), std::end(row.min), std::numeric_limits<double>::infinity());
    double weight = 0;
    for (const PhaseStats& r : all) {
      if (static_cast<int>(r.stage) != s) continue;
      for (int i = 0; i < PhaseTimes::count; ++i) {
        row.min[i] = std::min(row.min[i], r.min[i]);
        row.avg[i] += r.sum[i];
        row.max[i] = std::max(row.max[i], r.max[i]);
      }
      weight += r.weight;
      count += r.steps;
    }
    for (double& a : row.avg) a /= count;
    // Per action: a recomputation is part of its backward; model stages of one pipeline
    // stage share its times evenly.
    for (const int m : schedule.stages_of(s)) {
      measured.forward[m] = row.avg[0] / (micro_batches * v);
      measured.backward[m] = (row.avg[1] + row.avg[2]) / (micro_batches * v);
      measured.weight[m] = weight / count / (micro_batches * v);
    }
    std::printf("%-6d", s);
    for (int i = 0; i < PhaseTimes::count; ++i)
      std::printf(" %20s", cat(std::round(row.min[i] * 1e4) / 10, "/", std::round(row.avg[i] * 1e4) / 10, "/",
                               std::round(row.max[i] * 1e4) / 10).c_str());
    std::printf("\n");
  }
  *simulated = bubble_fraction(schedule, measured, overlapped);
  std::printf("bubble: measured %.1f%% (mean over steps; every rank's idle up to the slowest one's end%s), schedule's "
              "theoretical %.1f%% (unit costs), %.1f%% simulated with the measured action times\n",
              100 * mine.bubble / mine.steps, overlapped ? ", steps back to back" : "", 100 * theory, 100 * *simulated);
  return rows;
}

}  // namespace mpipe
