// Host names of the job's ranks, gathered once at start-up.
#include "mpipe/pipeline/comm/hosts.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <span>
#include <vector>

namespace mpipe {

namespace {

constexpr std::size_t name_bytes = 64;  // a host name is at most 64 bytes (HOST_NAME_MAX)

// World rank -> host name; written once by learn_hosts, before any thread that reads it.
std::vector<std::string> g_hosts;
int g_host_count = 1;

}  // namespace

std::string this_host() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

void learn_hosts(const Communicator& world) {
  std::array<char, name_bytes> mine{};
  const std::string host = this_host();
  std::copy_n(host.begin(), std::min(host.size(), name_bytes - 1), mine.begin());
  std::vector<char> all(name_bytes * static_cast<std::size_t>(world.size()));
  MPI_CHECK(MPI_Allgather(mine.data(), static_cast<int>(name_bytes), MPI_CHAR, all.data(), static_cast<int>(name_bytes),
                          MPI_CHAR, world.get()));
  std::vector<std::string> hosts(static_cast<std::size_t>(world.size()));
  for (std::size_t r = 0; r < hosts.size(); ++r) hosts[r] = std::string(all.data() + r * name_bytes);
  std::vector<std::string> distinct = hosts;
  std::sort(distinct.begin(), distinct.end());
  g_host_count = static_cast<int>(std::unique(distinct.begin(), distinct.end()) - distinct.begin());
  g_hosts = std::move(hosts);
}

int host_count() { return g_host_count; }

const std::vector<std::string>& hosts() { return g_hosts; }

HostTraffic host_traffic(const Plan& plan, const Model& model, const std::vector<std::string>& hosts) {
  const GridShape& grid = plan.grid;
  const Partition& part = plan.partition;
  MPIPE_CHECK(static_cast<int>(hosts.size()) == grid.stages * grid.replicas, hosts.size(), " hosts for a grid of ",
              grid.stages * grid.replicas, " ranks");
  std::map<std::string, HostTraffic> out;  // by host: what leaves it
  const auto host = [&](int rank) { return hosts[static_cast<std::size_t>(rank)]; };
  const std::vector<double> cut_bytes = boundary_bytes(model, plan.micro_batch_size, false);  // activation + gradient
  const double M = plan.options.micro_batches;
  for (int s = 0; s + 1 < part.stages(); ++s) {
    const double each_way = M * cut_bytes[static_cast<std::size_t>(part.end(s))] / 2;
    for (int r = 0; r < grid.replicas; ++r) {
      const int a = grid.rank_of(part.pipeline_stage(s), r), b = grid.rank_of(part.pipeline_stage(s + 1), r);
      if (host(a) == host(b)) continue;
      out[host(a)].boundary += each_way;  // activations on, and
      out[host(b)].boundary += each_way;  // gradients back
    }
  }
  // A skip crossing stages: straight from its producer's rank to its consumer's, and back.
  const std::vector<double> skips = skip_bytes(model, plan.micro_batch_size);
  for (std::size_t k = 0; k < skips.size(); ++k) {
    const int from = part.stage_of(model.skips()[k].producer), to = part.stage_of(model.skips()[k].consumer);
    for (int r = 0; r < grid.replicas && from != to; ++r) {
      const int a = grid.rank_of(part.pipeline_stage(from), r), b = grid.rank_of(part.pipeline_stage(to), r);
      if (host(a) == host(b)) continue;
      out[host(a)].boundary += M * skips[k];
      out[host(b)].boundary += M * skips[k];
    }
  }
  const int D = grid.replicas;
  Plan one_copy = plan;  // the gradients summed: one buffer, whatever --overlap-steps keeps besides
  one_copy.options.overlap_steps = false;
  for (int p = 0; p < grid.stages && D > 1; ++p) {
    const double ring = 2.0 * (D - 1) / D * one_copy.weight_memory(p, false).gradients;
    for (int r = 0; r < D; ++r) {
      const int a = grid.rank_of(p, r), b = grid.rank_of(p, (r + 1) % D);
      if (host(a) != host(b)) out[host(a)].sums += ring;
    }
  }
  HostTraffic busiest;
  for (auto& [name, traffic] : out)
    if (traffic.total() > busiest.total()) {
      busiest = traffic;
      busiest.host = name;
    }
  return busiest;
}

std::string choose_rank_order(const Plan& plan, const Model& model, const std::vector<std::string>& hosts,
                              std::string* why, double seconds_per_byte) {
  Plan other = plan;
  std::array<HostTraffic, 2> traffic;
  const std::array<const char*, 2> orders{"pipeline", "data"};
  for (std::size_t i = 0; i < orders.size(); ++i) {
    other.grid.rank_order = orders[i];
    traffic[i] = host_traffic(other, model, hosts);
  }
  const bool data = traffic[1].total() < traffic[0].total() * (1 - 0.01);
  if (why) {
    const auto mb = [](double bytes) { return cat(std::round(bytes / 1e5) / 10, " MB"); };
    *why = "";
    for (std::size_t i = 0; i < orders.size(); ++i)
      *why += cat(i ? "; " : "", orders[i], " order ", mb(traffic[i].total()), " (boundaries ", mb(traffic[i].boundary),
                  ", replica sums ", mb(traffic[i].sums), ")");
    if (seconds_per_byte > 0) {
      const auto ms = [&](const HostTraffic& t) { return cat(std::round(t.total() * seconds_per_byte * 1e4) / 10, " ms"); };
      *why += cat("; at ", std::round(1e-6 / seconds_per_byte) / 1e3, " GB/s between hosts ", ms(traffic[0]), " against ",
                  ms(traffic[1]), " a step");
    }
  }
  return data ? "data" : "pipeline";
}

double measure_host_link(const Communicator& world) {
  int peer = 0;
  while (peer < world.size() && host_of(peer) == host_of(0)) ++peer;
  double seconds_per_byte[1] = {0};
  if (peer < world.size()) {
    constexpr std::size_t bytes = std::size_t{1} << 20;
    if (world.rank() == 0) seconds_per_byte[0] = world.ping_pong(peer, bytes, true) / static_cast<double>(bytes);
    if (world.rank() == peer) world.ping_pong(0, bytes, false);
  }
  world.broadcast(std::span<double>(seconds_per_byte), 0);
  return seconds_per_byte[0];
}

std::string host_of(int rank) {
  return rank >= 0 && static_cast<std::size_t>(rank) < g_hosts.size() ? g_hosts[static_cast<std::size_t>(rank)] : "";
}

std::string describe_hosts() {
  if (g_host_count < 2) return "";
  std::vector<std::string> order;  // hosts in the order of their first rank
  for (const std::string& h : g_hosts)
    if (std::find(order.begin(), order.end(), h) == order.end()) order.push_back(h);
  std::string s = cat(g_host_count, " hosts:");
  for (std::size_t i = 0; i < order.size() && i < 8; ++i) {
    s += cat(i ? ", " : " ", order[i], " rank");
    std::string ranks;
    int count = 0;
    for (int r = 0; r < static_cast<int>(g_hosts.size());) {  // runs of consecutive ranks: "0-3,8"
      if (g_hosts[static_cast<std::size_t>(r)] != order[i]) { ++r; continue; }
      int end = r;
      while (end + 1 < static_cast<int>(g_hosts.size()) && g_hosts[static_cast<std::size_t>(end + 1)] == order[i]) ++end;
      ranks += cat(ranks.empty() ? "" : ",", r, end > r ? cat("-", end) : "");
      count += end - r + 1;
      r = end + 1;
    }
    s += cat(count > 1 ? "s " : " ", ranks);
  }
  return order.size() > 8 ? s + ", …" : s;
}

std::string rank_on_host(int rank) { return cat("rank ", rank, on_host(rank)); }

std::string on_host(int rank) {
  if (g_host_count < 2) return "";
  const std::string host = host_of(rank);
  return host.empty() ? "" : " on " + host;
}

}  // namespace mpipe
