// MPI wrappers.
#include "mpipe/pipeline/comm.hpp"

#include <chrono>
#include <climits>
#include <thread>

namespace mpipe {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<std::size_t>(length));
}

namespace {
int count_of(std::size_t n) {
  MPIPE_CHECK(n <= static_cast<std::size_t>(INT_MAX), "message of ", n, " elements exceeds MPI's int count");
  return static_cast<int>(n);
}
}  // namespace

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
  if (c.comm_ == MPI_COMM_NULL) return c;
  c.owned_ = true;
  MPI_CHECK(MPI_Comm_set_errhandler(c.comm_, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(c.comm_, &c.rank_));
  MPI_CHECK(MPI_Comm_size(c.comm_, &c.size_));
  return c;
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

MPI_Request Communicator::isend(std::span<const float> data, int dest, int tag) const {
  MPI_Request r;
  MPI_CHECK(MPI_Isend(data.data(), count_of(data.size()), MPI_FLOAT, dest, tag, comm_, &r));
  return r;
}

MPI_Request Communicator::irecv(std::span<float> data, int source, int tag) const {
  MPI_Request r;
  MPI_CHECK(MPI_Irecv(data.data(), count_of(data.size()), MPI_FLOAT, source, tag, comm_, &r));
  return r;
}

MPI_Request Communicator::iallreduce_sum(std::span<float> data) const {
  MPI_Request r;
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data.data(), count_of(data.size()), MPI_FLOAT, MPI_SUM, comm_, &r));
  return r;
}

void Communicator::allreduce_sum(std::span<float> data) const {
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data.data(), count_of(data.size()), MPI_FLOAT, MPI_SUM, comm_));
}

void Communicator::allreduce_sum(std::span<double> data) const {
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data.data(), count_of(data.size()), MPI_DOUBLE, MPI_SUM, comm_));
}

void Communicator::allreduce_max(std::span<double> data) const {
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data.data(), count_of(data.size()), MPI_DOUBLE, MPI_MAX, comm_));
}

void Communicator::broadcast(std::span<double> data, int root) const {
  MPI_CHECK(MPI_Bcast(data.data(), count_of(data.size()), MPI_DOUBLE, root, comm_));
}

void Communicator::barrier() const { MPI_CHECK(MPI_Barrier(comm_)); }

double wait_for(MPI_Request& request, double timeout_s, const char* what, int index) {
  if (request == MPI_REQUEST_NULL) return 0.0;
  const auto start = std::chrono::steady_clock::now();
  int done = 0;
  // Spin briefly (the common case is a message already on its way), then back off so
  // that oversubscribed ranks leave the core to the rank that has work.
  for (int polls = 0;; ++polls) {
    MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (done) break;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s)
      throw Error(cat("timed out after ", timeout_s, " s waiting for ", what, " ", index,
                      " (a neighbour stage is stuck or gone; see --p2p-timeout)"));
    if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(polls > 100000 ? 1000 : 20));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double wait_all(std::span<MPI_Request> requests, double timeout_s, const char* what) {
  double total = 0.0;
  for (std::size_t i = 0; i < requests.size(); ++i) total += wait_for(requests[i], timeout_s, what, static_cast<int>(i));
  return total;
}

}  // namespace mpipe
