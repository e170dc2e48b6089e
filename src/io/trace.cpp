// Chrome trace writer and run summary.
#include "mpipe/io/trace.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace mpipe {

namespace {

// Closes an output file; UserError when anything written to it (or the open) failed: a
// full disk is said, never reported as written.
void close_output(std::FILE* out, const std::string& path, const char* what, const char* option) {
  const bool failed = !out || std::ferror(out);
  if ((out && std::fclose(out) != 0) || failed)
    throw UserError(cat("cannot write ", what, " file '", path, "': ", std::strerror(errno ? errno : EIO)),
                    cat("free space there, or give ", option, " a file on another file system"));
}

std::string event_label(const TraceEvent& e) {
  static const char* prefix[TraceEvent::count] = {"F", "B", "R", "SF", "RF", "SB", "RB", "", "", "", "", "", "W"};
  if (e.layer >= 0) return cat(TraceEvent::name(e.kind), " L", e.layer);
  if (e.micro_batch < 0) return TraceEvent::name(e.kind);
  return cat(e.stage >= 0 ? std::to_string(e.stage) : std::string(), prefix[e.kind], e.micro_batch);
}

// Transfers overlap one another (a send still moving when the next is posted, several
// gradient sums at once), and a track's boxes must nest: each goes on the first lane of
// its rank's communication tracks that is free by its start. Returns the lane of each
// event (-1: a compute track event) and the number of lanes.
// At most this many communication lanes per rank (more share the last); a rank's tracks
// sort as (its place in the grid) * (max_lanes + 1) + lane.
constexpr int max_lanes = 1023;

int assign_lanes(const TraceEvent* events, std::size_t n, std::vector<int>& lane) {
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < n; ++i)
    if (TraceEvent::communication(events[i].kind)) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return events[a].start < events[b].start; });
  lane.assign(n, -1);
  std::vector<double> free_at;  // per lane, when its last box ends
  for (const std::size_t i : order) {
    std::size_t l = 0;
    while (l < free_at.size() && free_at[l] > events[i].start) ++l;
    if (l == free_at.size()) free_at.push_back(0.0);
    free_at[l] = events[i].end;
    lane[i] = static_cast<int>(l);
  }
  return static_cast<int>(free_at.size());
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
               exec.options().schedule.c_str(), world.size());
  // Per rank: its compute track (tid = rank), then its communication tracks (tid =
  // rank + world size * (1 + lane)), ordered by replica then stage so that a replica's
  // pipeline reads top to bottom.
  const int W = world.size();
  auto track = [&](int tid, int rank, int lanes_before, const std::string& name) {
    std::fprintf(out, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, \"args\": {\"name\": "
                 "\"%s\"}}", tid, name.c_str());
    const int order = places[2 * rank + 1] * exec.grid().stages() + places[2 * rank];
    std::fprintf(out, ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, \"args\": "
                 "{\"sort_index\": %d}}", tid, order * (max_lanes + 1) + lanes_before);
  };
  std::size_t at = 0;
  std::vector<int> lane;
  for (int r = 0; r < W; ++r) {
    const auto n = static_cast<std::size_t>(counts[r]) / sizeof(TraceEvent);
    const int lanes = assign_lanes(all.data() + at, n, lane);
    const std::string rank_name = cat("rank ", r, ": stage ", places[2 * r], ", replica ", places[2 * r + 1]);
    track(r, r, 0, rank_name);
    for (int l = 0; l < std::min(lanes, max_lanes); ++l)
      track(r + W * (1 + l), r, 1 + l, cat(rank_name, ": communication", l ? cat(" ", l + 1) : std::string()));
    for (std::size_t i = 0; i < n; ++i, ++at) {
      const TraceEvent& e = all[at];
      const int tid = lane[i] < 0 ? r : r + W * (1 + std::min(lane[i], max_lanes - 1));
      std::fprintf(out,
                   ",\n{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": 0, \"tid\": %d, \"ts\": %.3f, "
                   "\"dur\": %.3f, \"args\": {\"step\": %d, \"micro_batch\": %d, \"layer\": %d, \"rank\": %d}}",
                   event_label(e).c_str(), TraceEvent::name(e.kind), tid, e.start * 1e6, (e.end - e.start) * 1e6, e.step + 1,
                   e.micro_batch, e.layer, r);
    }
  }
  std::fprintf(out, "\n]}\n");
  close_output(out, path, "trace", "--trace");
}

void write_summary(const std::string& path, const std::string& json) {
  std::FILE* out = std::fopen(path.c_str(), "w");
  if (out) std::fprintf(out, "%s\n", json.c_str());
  close_output(out, path, "summary", "--summary");
}

std::string summary_json(const Executor& exec, const RunSummary& s) {
  const RunOptions& c = exec.options();
  const Grid& g = exec.grid();
  std::string per_rank, per_stage;
  std::vector<double> stage_peak(g.stages(), 0.0);
  for (std::size_t r = 0; r < s.peak_bytes_per_rank.size(); ++r) {
    per_rank += cat(r ? ", " : "", static_cast<long long>(s.peak_bytes_per_rank[r]));
    const int stage = g.shape().stage_of(static_cast<int>(r));
    stage_peak[stage] = std::max(stage_peak[stage], s.peak_bytes_per_rank[r]);
  }
  for (int st = 0; st < g.stages(); ++st) per_stage += cat(st ? ", " : "", static_cast<long long>(stage_peak[st]));
  // "phase_s": per stage, each phase's [min, mean, max] seconds per step.
  std::string phases;
  for (std::size_t st = 0; st < s.phases.size(); ++st) {
    phases += cat(st ? ", " : "", "{\"stage\": ", st);
    for (int i = 0; i < PhaseTimes::count; ++i) {
      std::string key = PhaseTimes::name(i);
      std::replace(key.begin(), key.end(), ' ', '_');
      char triple[96];
      std::snprintf(triple, sizeof triple, "[%.6g, %.6g, %.6g]", s.phases[st].min[i], s.phases[st].avg[i],
                    s.phases[st].max[i]);
      phases += cat(", \"", key, "\": ", triple);
    }
    phases += "}";
  }
  char numbers[512];
  std::snprintf(numbers, sizeof numbers,
                "\"steps_timed\": %lld, \"step_time_s\": %.9g, \"samples_per_s\": %.9g, \"tokens_per_s\": %.9g, "
                "\"bubble_fraction\": %.9g, \"theoretical_bubble\": %.9g, \"simulated_bubble\": %.9g",
                s.steps, s.median_step_s, s.samples_per_s, s.tokens_per_s, s.bubble, s.theoretical_bubble,
                s.simulated_bubble);
  return cat("{\"summary\": true, \"model\": \"", c.model.kind, "\", \"stages\": ", g.stages(), ", \"replicas\": ",
             g.replicas(), ", \"micro_batches\": ", c.micro_batches, ", \"batch_size\": ", c.batch_size,
             ", \"schedule\": \"", c.schedule, "\", \"virtual_stages\": ", c.virtual_stages,
             ", \"remat\": \"", to_string(c.remat), "\", \"overlap_steps\": ", c.overlap_steps ? "true" : "false",
             ", \"updates_ahead\": ", exec.speculated(), ", \"updates_undone\": ", exec.rolled_back(), ", ", numbers,
             ", \"peak_activation_bytes_per_stage\": [", per_stage, "], \"peak_activation_bytes_per_rank\": [", per_rank,
             "], \"phase_s\": [", phases, "]}");
}

}  // namespace mpipe
