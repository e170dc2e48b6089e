// Typed wrappers over MPI: spans carry the count (never counted by hand), every call is
// checked and turned into an exception with context, and tags come from (micro-batch,
// direction). Non-blocking requests are waited on through Progress (progress.hpp).
#pragma once
#include <mpi.h>

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

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

enum class Reduce { sum, max, min };

template <class T>
MPI_Datatype mpi_datatype();
template <> inline MPI_Datatype mpi_datatype<int>() { return MPI_INT; }
template <> inline MPI_Datatype mpi_datatype<unsigned>() { return MPI_UNSIGNED; }
template <> inline MPI_Datatype mpi_datatype<float>() { return MPI_FLOAT; }
template <> inline MPI_Datatype mpi_datatype<double>() { return MPI_DOUBLE; }
template <> inline MPI_Datatype mpi_datatype<char>() { return MPI_CHAR; }
MPI_Op mpi_op(Reduce op);
int mpi_count(std::size_t n);  // checked against MPI's int counts

// Activations travel forward, gradients backward; each micro-batch (with virtual
// stages, each (model stage, micro-batch)) has its own tag, 2 · index + direction. MPI
// promises tags up to 32767, so at most this many messages per direction tell apart:
inline constexpr int max_tagged_messages = 16383;
inline int message_tag(int micro_batch, Direction direction) {
  return 2 * micro_batch + static_cast<int>(direction);
}

// A communicator we own (freed on destruction) or borrow (world, self).
class Communicator {
 public:
  Communicator() = default;
  static Communicator borrow(MPI_Comm comm);
  static Communicator split(const Communicator& parent, int color, int key);  // MPI_UNDEFINED: null
  // The ranks of `parent` that share this rank's node (memory), in parent rank order.
  static Communicator node(const Communicator& parent);
  Communicator(Communicator&& other) noexcept;
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  ~Communicator();

  bool null() const { return comm_ == MPI_COMM_NULL; }
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Messages between stages are bytes: activations travel in the compute precision.
  // The spans may be device memory when MPI is CUDA-aware (see mpi_cuda_aware()).
  MPI_Request isend(std::span<const std::byte> data, int dest, int tag) const;
  MPI_Request irecv(std::span<std::byte> data, int source, int tag) const;
  // Reductions in place, over spans of int, uint32_t, float or double.
  template <class T>
  void allreduce(std::span<T> data, Reduce op) const;
  template <class T>
  MPI_Request iallreduce(std::span<T> data, Reduce op) const;
  template <class T>
  void broadcast(std::span<T> data, int root) const;
  void broadcast(std::string& text, int root) const;  // any length
  // Every rank's `mine` (plain data, sent as bytes) at `root`, in rank order; empty on the
  // other ranks.
  template <class T>
  std::vector<T> gather(const T& mine, int root) const;
  // Every rank's `mine` (any length each) at `root`, one after another in rank order, and
  // how many each sent (*counts, on root); empty on the other ranks.
  template <class T>
  std::vector<T> gather(std::span<const T> mine, int root, std::vector<int>* counts) const;
  void barrier() const;
  // Seconds one message of `bytes` takes from this rank to `peer`, which calls this too
  // (one of the two with `initiator`): the best of `rounds` round trips, halved, after an
  // unmeasured one that touches the buffers. Host memory; blocking.
  double ping_pong(int peer, std::size_t bytes, bool initiator, int rounds = 5) const;

 private:
  static Communicator own(Communicator& fresh);  // takes a new handle: freed, errors returned
  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0, size_ = 1;
};

// Whether MPI can send from and receive into GPU memory: Open MPI's run-time answer
// (MPIX_Query_cuda_support), overridden by MPIPE_CUDA_AWARE=0|1 in the environment.
bool mpi_cuda_aware();
template <class T>
void Communicator::allreduce(std::span<T> data, Reduce op) const {
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data.data(), mpi_count(data.size()), mpi_datatype<T>(), mpi_op(op), comm_));
}

template <class T>
MPI_Request Communicator::iallreduce(std::span<T> data, Reduce op) const {
  MPI_Request r;
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data.data(), mpi_count(data.size()), mpi_datatype<T>(), mpi_op(op), comm_, &r));
  return r;
}

template <class T>
void Communicator::broadcast(std::span<T> data, int root) const {
  MPI_CHECK(MPI_Bcast(data.data(), mpi_count(data.size()), mpi_datatype<T>(), root, comm_));
}

template <class T>
std::vector<T> Communicator::gather(const T& mine, int root) const {
  static_assert(std::is_trivially_copyable_v<T>, "gathered as bytes");
  std::vector<T> all(rank_ == root ? static_cast<std::size_t>(size_) : 0);
  MPI_CHECK(MPI_Gather(&mine, mpi_count(sizeof(T)), MPI_BYTE, all.data(), mpi_count(sizeof(T)), MPI_BYTE, root, comm_));
  return all;
}

template <class T>
std::vector<T> Communicator::gather(std::span<const T> mine, int root, std::vector<int>* counts) const {
  static_assert(std::is_trivially_copyable_v<T>, "gathered as bytes");
  const int bytes = mpi_count(mine.size_bytes());
  const std::vector<int> sizes = gather(bytes, root);
  std::vector<int> offsets(sizes.size());
  std::size_t total = 0;
  for (std::size_t r = 0; r < sizes.size(); ++r) {
    offsets[r] = mpi_count(total);
    total += static_cast<std::size_t>(sizes[r]);
  }
  std::vector<T> all(total / sizeof(T));
  MPI_CHECK(MPI_Gatherv(mine.data(), bytes, MPI_BYTE, all.data(), sizes.data(), offsets.data(), MPI_BYTE, root, comm_));
  if (counts) {
    counts->clear();
    for (const int b : sizes) counts->push_back(b / static_cast<int>(sizeof(T)));
  }
  return all;
}

}  // namespace mpipe
