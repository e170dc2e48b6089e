// Host names of the job's ranks, gathered once at start-up.
#include "mpipe/pipeline/hosts.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
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
    for (int r = 0; r < static_cast<int>(g_hosts.size());) {  // runs of consecutive ranks: "0-3, 8"
      if (g_hosts[static_cast<std::size_t>(r)] != order[i]) { ++r; continue; }
      int end = r;
      while (end + 1 < static_cast<int>(g_hosts.size()) && g_hosts[static_cast<std::size_t>(end + 1)] == order[i]) ++end;
      ranks += cat(ranks.empty() ? "" : " ", r, end > r ? cat("-", end) : "");
      count += end - r + 1;
      r = end + 1;
    }
    s += cat(count > 1 ? "s " : " ", ranks);
  }
  return order.size() > 8 ? s + ", …" : s;
}

std::string on_host(int rank) {
  if (g_host_count < 2) return "";
  const std::string host = host_of(rank);
  return host.empty() ? "" : " on " + host;
}

}  // namespace mpipe
