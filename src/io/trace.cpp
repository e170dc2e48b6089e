// The Chrome / Perfetto trace of every rank's actions.
#include "mpipe/io/trace.hpp"

#include <cmath>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "mpipe/io/json.hpp"

namespace mpipe {

namespace {

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
  std::vector<int> counts;
  const std::vector<TraceEvent> all = world.gather(std::span<const TraceEvent>(mine), 0, &counts);
  struct Place {
    int stage, replica;
  };
  const std::vector<Place> places = world.gather(Place{exec.grid().stage(), exec.grid().replica()}, 0);
  if (world.rank() != 0) return;

  std::FILE* out = std::fopen(path.c_str(), "w");
  MPIPE_REQUIRE(out, "check that the directory exists and is writable", "cannot write trace file '", path, "': ",
                std::strerror(errno));
  // One event per line, so the file reads (and greps) line by line.
  std::fprintf(out, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  bool first = true;
  const auto emit = [&](const Json& event) {
    std::fprintf(out, "%s%s", first ? "" : ",\n", event.dump().c_str());
    first = false;
  };
  emit({{"name", "process_name"}, {"ph", "M"}, {"pid", 0},
        {"args", {{"name", cat("mpipe ", exec.options().schedule, ", ", world.size(), " ranks")}}}});
  // Per rank: its compute track (tid = rank), then its communication tracks (tid =
  // rank + world size * (1 + lane)), ordered by replica then stage so that a replica's
  // pipeline reads top to bottom.
  const int W = world.size();
  auto track = [&](int tid, int rank, int lanes_before, const std::string& name) {
    emit({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", tid}, {"args", {{"name", name}}}});
    const Place& p = places[static_cast<std::size_t>(rank)];
    const int order = p.replica * exec.grid().stages() + p.stage;
    emit({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 0}, {"tid", tid},
          {"args", {{"sort_index", order * (max_lanes + 1) + lanes_before}}}});
  };
  std::size_t at = 0;
  std::vector<int> lane;
  for (int r = 0; r < W; ++r) {
    const auto n = static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
    const int lanes = assign_lanes(all.data() + at, n, lane);
    const Place& p = places[static_cast<std::size_t>(r)];
    const std::string rank_name = cat("rank ", r, ": stage ", p.stage, ", replica ", p.replica);
    track(r, r, 0, rank_name);
    for (int l = 0; l < std::min(lanes, max_lanes); ++l)
      track(r + W * (1 + l), r, 1 + l, cat(rank_name, ": communication", l ? cat(" ", l + 1) : std::string()));
    for (std::size_t i = 0; i < n; ++i, ++at) {
      const TraceEvent& e = all[at];
      const int tid = lane[i] < 0 ? r : r + W * (1 + std::min(lane[i], max_lanes - 1));
      // Times in microseconds, to the nanosecond.
      emit({{"name", event_label(e)}, {"cat", TraceEvent::name(e.kind)}, {"ph", "X"}, {"pid", 0}, {"tid", tid},
            {"ts", std::round(e.start * 1e9) / 1e3}, {"dur", std::round((e.end - e.start) * 1e9) / 1e3},
            {"args", {{"step", e.step + 1}, {"micro_batch", e.micro_batch}, {"layer", e.layer}, {"rank", r}}}});
    }
  }
  std::fprintf(out, "\n]}\n");
  close_output(out, path, "trace", "--trace");
}

}  // namespace mpipe
