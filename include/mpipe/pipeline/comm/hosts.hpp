// The host each rank of the job runs on, so that a line naming a rank (one that stopped
// answering, a wait that timed out) names its node too when the job spans several.
#pragma once
#include <string>
#include <vector>

#include "mpipe/pipeline/comm/comm.hpp"
#include "mpipe/pipeline/plan/plan.hpp"

namespace mpipe {

// This machine's host name ("?" when it cannot be read).
std::string this_host();

// Collective over `world`: every rank learns every rank's host name. Before it (and in
// programs that never call it) ranks are named without their hosts.
void learn_hosts(const Communicator& world);

// How many distinct hosts the job has (1 until learn_hosts).
int host_count();

// The host of world rank `rank`, or "" when not learned.
std::string host_of(int rank);

// "2 hosts: node1 ranks 0-1, node2 ranks 2-3" ("ranks 0,2" where not consecutive; at most 8
// hosts named), "" on one host.
std::string describe_hosts();

// Every rank's host, by world rank (empty until learn_hosts).
const std::vector<std::string>& hosts();

// Bytes one step sends out of the busiest host, by what they carry, under the plan's grid
// and rank order, with world rank r on hosts[r]: the boundary activations and gradients
// (every micro-batch) between neighbouring model stages on different hosts, and each
// replica sum as a ring over the stage's replicas (2(D-1)/D of the stage's gradients from
// each rank to the next) where ring neighbours are on different hosts. A host's traffic
// shares its one link (its network card); the step waits for the busiest. Messages within
// a host (shared memory) and the tied weights' pair sum are not counted.
struct HostTraffic {
  std::string host;            // the busiest
  double boundary = 0, sums = 0;
  double total() const { return boundary + sums; }
};
HostTraffic host_traffic(const Plan& plan, const Model& model, const std::vector<std::string>& hosts);

// --rank-order auto on several hosts: the order whose busiest host sends fewer bytes per
// step (pipeline on a tie within 1%, and wherever one host, one replica or one stage
// leaves nothing to choose). `why` gets both orders' figures, and with
// `seconds_per_byte` > 0 (the link between hosts) the time each takes on that link.
std::string choose_rank_order(const Plan& plan, const Model& model, const std::vector<std::string>& hosts,
                              std::string* why = nullptr, double seconds_per_byte = 0);

// Collective over `world` (after learn_hosts, on several hosts): the seconds per byte
// between world rank 0 and the first rank on another host, by a ping-pong of 1 MiB
// (the best of 5), on every rank.
double measure_host_link(const Communicator& world);

// "rank 3", or "rank 3 on node7" in a job on several hosts: how lines name a world rank.
std::string rank_on_host(int rank);

// " on HOST" for a rank of a job on several hosts, else "" (one node: the host adds
// nothing). `rank` is a world rank.
std::string on_host(int rank);

}  // namespace mpipe
