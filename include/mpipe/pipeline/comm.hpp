// Typed wrappers over MPI: spans carry the count (never counted by hand), every call is
// checked and turned into an exception with context, tags come from (micro-batch,
// direction), and waits time out instead of hanging.
#pragma once
#include <mpi.h>

#include <span>
#include <string>

#include "mpipe/core/error.hpp"

#define MPI_CHECK(call)                                                                   \
  do {                                                                                    \
    const int mpi_check_rc_ = (call);                                                     \
    if (mpi_check_rc_ != MPI_SUCCESS) [[unlikely]]                                        \
      ::mpipe::throw_check_failure(__FILE__, __LINE__, #call, ::mpipe::mpi_error_string(mpi_check_rc_)); \
  } while (0)

namespace mpipe {

std::string mpi_error_string(int code);

enum class Direction : int { forward = 0, backward = 1 };

// Activations travel forward, gradients backward; each micro-batch has its own tag.
inline int message_tag(int micro_batch, Direction direction) {
  return 2 * micro_batch + static_cast<int>(direction);
}

// A communicator we own (freed on destruction) or borrow (world, self).
class Communicator {
 public:
  Communicator() = default;
  static Communicator borrow(MPI_Comm comm);
  static Communicator split(const Communicator& parent, int color, int key);  // MPI_UNDEFINED: null
  Communicator(Communicator&& other) noexcept;
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  ~Communicator();

  bool null() const { return comm_ == MPI_COMM_NULL; }
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  MPI_Request isend(std::span<const float> data, int dest, int tag) const;
  MPI_Request irecv(std::span<float> data, int source, int tag) const;
  MPI_Request iallreduce_sum(std::span<float> data) const;  // in place
  void allreduce_sum(std::span<float> data) const;
  void allreduce_sum(std::span<double> data) const;
  MPI_Request iallreduce_sum(std::span<double> data) const;  // in place
  void allreduce_max(std::span<double> data) const;
  void broadcast(std::span<double> data, int root) const;
  void barrier() const;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0, size_ = 1;
};

// Waits for `request`, polling so that a wait past `timeout_s` seconds throws an Error
// naming `what` and `index` ("activation of micro-batch", 3) instead of hanging.
// For a receive, expected_count (>= 0) is checked against the floats that arrived.
// Returns the seconds spent waiting.
double wait_for(MPI_Request& request, double timeout_s, const char* what, int index, long expected_count);
// Waits for all requests (nulls allowed), with the same timeout.
double wait_all(std::span<MPI_Request> requests, double timeout_s, const char* what);

}  // namespace mpipe
