// Typed, checked MPI: communicators, point-to-point, reductions, gathers, ping-pong.
#include "mpipe/pipeline/comm/comm.hpp"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI: MPIX_Query_cuda_support
#endif

namespace mpipe {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<std::size_t>(length));
}

int mpi_count(std::size_t n) {
  MPIPE_CHECK(n <= static_cast<std::size_t>(INT_MAX), "message of ", n, " elements exceeds MPI's int count");
  return static_cast<int>(n);
}

MPI_Op mpi_op(Reduce op) {
  switch (op) {
    case Reduce::sum: return MPI_SUM;
    case Reduce::max: return MPI_MAX;
    case Reduce::min: return MPI_MIN;
  }
  return MPI_SUM;
}

Communicator Communicator::borrow(MPI_Comm comm) {
  Communicator c;
  c.comm_ = comm;
  MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(comm, &c.rank_));
  MPI_CHECK(MPI_Comm_size(comm, &c.size_));
  return c;
}

Communicator Communicator::split(const Communicator& parent, int color, int key) {
  Communicator c;
  MPI_CHECK(MPI_Comm_split(parent.comm_, color, key, &c.comm_));
  return own(c);
}

Communicator Communicator::node(const Communicator& parent) {
  Communicator c;
  MPI_CHECK(MPI_Comm_split_type(parent.comm_, MPI_COMM_TYPE_SHARED, parent.rank_, MPI_INFO_NULL, &c.comm_));
  return own(c);
}

Communicator Communicator::own(Communicator& c) {
  if (c.comm_ == MPI_COMM_NULL) return std::move(c);
  c.owned_ = true;
  MPI_CHECK(MPI_Comm_set_errhandler(c.comm_, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(c.comm_, &c.rank_));
  MPI_CHECK(MPI_Comm_size(c.comm_, &c.size_));
  return std::move(c);
}

Communicator::Communicator(Communicator&& o) noexcept { *this = std::move(o); }

Communicator& Communicator::operator=(Communicator&& o) noexcept {
  if (this != &o) {
    if (owned_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = o.comm_;
    owned_ = o.owned_;
    rank_ = o.rank_;
    size_ = o.size_;
    o.comm_ = MPI_COMM_NULL;
    o.owned_ = false;
  }
  return *this;
}

Communicator::~Communicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

MPI_Request Communicator::isend(std::span<const std::byte> data, int dest, int tag) const {
  MPI_Request r;
  MPI_CHECK(MPI_Isend(data.data(), mpi_count(data.size()), MPI_BYTE, dest, tag, comm_, &r));
  return r;
}

MPI_Request Communicator::irecv(std::span<std::byte> data, int source, int tag) const {
  MPI_Request r;
  MPI_CHECK(MPI_Irecv(data.data(), mpi_count(data.size()), MPI_BYTE, source, tag, comm_, &r));
  return r;
}

bool mpi_cuda_aware() {
  if (const char* forced = std::getenv("MPIPE_CUDA_AWARE")) return std::string(forced) == "1";
#if defined(OMPI_HAVE_MPI_EXT_CUDA) && OMPI_HAVE_MPI_EXT_CUDA
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

void Communicator::broadcast(std::string& text, int root) const {
  int length = static_cast<int>(text.size());
  broadcast(std::span<int>(&length, 1), root);
  text.resize(static_cast<std::size_t>(length));
  broadcast(std::span<char>(text.data(), text.size()), root);
}

void Communicator::barrier() const { MPI_CHECK(MPI_Barrier(comm_)); }

double Communicator::ping_pong(int peer, std::size_t bytes, bool initiator, int rounds) const {
  constexpr int tag = 32000;  // before the transport exists: no other message is in flight
  std::vector<std::byte> buffer(bytes, std::byte{1});
  const int count = mpi_count(bytes);
  double best = std::numeric_limits<double>::infinity();
  for (int round = 0; round <= rounds; ++round) {
    const double start = MPI_Wtime();
    if (initiator) {
      MPI_CHECK(MPI_Send(buffer.data(), count, MPI_BYTE, peer, tag, comm_));
      MPI_CHECK(MPI_Recv(buffer.data(), count, MPI_BYTE, peer, tag, comm_, MPI_STATUS_IGNORE));
    } else {
      MPI_CHECK(MPI_Recv(buffer.data(), count, MPI_BYTE, peer, tag, comm_, MPI_STATUS_IGNORE));
      MPI_CHECK(MPI_Send(buffer.data(), count, MPI_BYTE, peer, tag, comm_));
    }
    if (round > 0) best = std::min(best, (MPI_Wtime() - start) / 2);
  }
  return best;
}

}  // namespace mpipe
