// The host each rank of the job runs on, so that a line naming a rank (one that stopped
// answering, a wait that timed out) names its node too when the job spans several.
#pragma once
#include <string>

#include "mpipe/pipeline/comm.hpp"

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

// "2 hosts: node1 ranks 0-1, node2 ranks 2-3" (at most 8 hosts named), "" on one host.
std::string describe_hosts();

// " on HOST" for a rank of a job on several hosts, else "" (one node: the host adds
// nothing). `rank` is a world rank.
std::string on_host(int rank);

}  // namespace mpipe
