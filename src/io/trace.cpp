// Chrome trace writer and run summary.
#include "mpipe/io/trace.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace mpipe {

namespace {

std::string event_label(const TraceEvent& e) {
  static const char* prefix[TraceEvent::count] = {"F", "B", "R", "SF", "RF", "SB", "RB", "", "", ""};
  if (e.micro_batch < 0) return TraceEvent::name(e.kind);
  return cat(prefix[e.kind], e.micro_batch);
}

}  // namespace

void write_trace(const Executor& exec, const std::string& path) {
  const Communicator& world = exec.grid().world();
  const std::vector<TraceEvent>& mine = exec.trace_events();
  const int bytes = static_cast<int>(mine.size() * sizeof(TraceEvent));
  const int where[2] = {exec.grid().stage(), exec.grid().replica()};
  const bool root = world.rank() == 0;
  std::vector<int> counts(root ? world.size() : 0), offsets(root ? world.size() : 0), places(root ? 2 * world.size() : 0);
  MPI_CHECK(MPI_Gather(&bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, world.get()));
  MPI_CHECK(MPI_Gather(where, 2, MPI_INT, places.data(), 2, MPI_INT, 0, world.get()));
  long long total = 0;
  for (int r = 0; r < static_cast<int>(counts.size()); ++r) offsets[r] = static_cast<int>(total), total += counts[r];
  std::vector<TraceEvent> all(root ? static_cast<std::size_t>(total) / sizeof(TraceEvent) : 0);
  MPI_CHECK(MPI_Gatherv(mine.data(), bytes, MPI_BYTE, all.data(), counts.data(), offsets.data(), MPI_BYTE, 0, world.get()));
  if (!root) return;

  std::FILE* out = std::fopen(path.c_str(), "w");
  MPIPE_REQUIRE(out, "check that the directory exists and is writable", "cannot write trace file '", path, "': ",
                std::strerror(errno));
  std::fprintf(out, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  std::fprintf(out, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"args\": {\"name\": \"mpipe %s, %d ranks\"}}",
               exec.config().pipeline.schedule.c_str(), world.size());
  for (int r = 0; r < world.size(); ++r) {
    // One track per rank, ordered by replica then stage so a replica's pipeline reads
    // top to bottom.
    std::fprintf(out, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, \"args\": {\"name\": "
                 "\"rank %d: stage %d, replica %d\"}}", r, r, places[2 * r], places[2 * r + 1]);
    std::fprintf(out, ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, \"args\": "
                 "{\"sort_index\": %d}}", r, places[2 * r + 1] * exec.grid().stages() + places[2 * r]);
  }
  std::size_t at = 0;
  for (int r = 0; r < world.size(); ++r)
    for (int i = 0; i < counts[r] / static_cast<int>(sizeof(TraceEvent)); ++i, ++at) {
      const TraceEvent& e = all[at];
      std::fprintf(out,
                   ",\n{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": 0, \"tid\": %d, \"ts\": %.3f, "
                   "\"dur\": %.3f, \"args\": {\"step\": %d, \"micro_batch\": %d}}",
                   event_label(e).c_str(), TraceEvent::name(e.kind), r, e.start * 1e6, (e.end - e.start) * 1e6, e.step,
                   e.micro_batch);
    }
  std::fprintf(out, "\n]}\n");
  std::fclose(out);
}

std::string summary_json(const Executor& exec, const RunSummary& s) {
  const TrainConfig& c = exec.config();
  const Grid& g = exec.grid();
  std::string per_rank, per_stage;
  std::vector<double> stage_peak(g.stages(), 0.0);
  for (std::size_t r = 0; r < s.peak_bytes_per_rank.size(); ++r) {
    per_rank += cat(r ? ", " : "", static_cast<long long>(s.peak_bytes_per_rank[r]));
    const int stage = g.shape().stage_of(static_cast<int>(r));
    stage_peak[stage] = std::max(stage_peak[stage], s.peak_bytes_per_rank[r]);
  }
  for (int st = 0; st < g.stages(); ++st) per_stage += cat(st ? ", " : "", static_cast<long long>(stage_peak[st]));
  char numbers[512];
  std::snprintf(numbers, sizeof numbers,
                "\"steps_timed\": %lld, \"step_time_s\": %.9g, \"samples_per_s\": %.9g, \"tokens_per_s\": %.9g, "
                "\"bubble_fraction\": %.9g, \"theoretical_bubble\": %.9g",
                s.steps, s.median_step_s, s.samples_per_s, s.tokens_per_s, s.bubble, s.theoretical_bubble);
  return cat("{\"summary\": true, \"model\": \"", c.model.kind, "\", \"stages\": ", g.stages(), ", \"replicas\": ",
             g.replicas(), ", \"micro_batches\": ", c.micro_batches, ", \"batch_size\": ", c.batch_size,
             ", \"schedule\": \"", c.pipeline.schedule, "\", \"remat\": \"", c.pipeline.remat, "\", ", numbers,
             ", \"peak_activation_bytes_per_stage\": [", per_stage, "], \"peak_activation_bytes_per_rank\": [", per_rank,
             "]}");
}

}  // namespace mpipe
