// Small HDF5 helpers for the floors that read or write HDF5 files (data/ for labelled
// data sets, io/ for checkpoints).
#pragma once
#include <hdf5.h>

#include <pthread.h>
#include <sched.h>

#include <mutex>

#include <utility>

namespace mpipe {

// Closes an HDF5 handle with the right function when it goes out of scope.
class Handle {
 public:
  Handle() = default;
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle&& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
    return *this;
  }
  Handle(const Handle&) = delete;
  ~Handle() {
    if (id_ >= 0 && close_) close_(id_);
  }
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_ = H5I_INVALID_HID;
  herr_t (*close_)(hid_t) = nullptr;
};

// Our messages say what went wrong in one line; HDF5's own error stack is noise.
inline void quiet_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
// The HDF5 library here is not thread-safe: a thread that calls it while another may
// (a data reader, --checkpoint-async's writer) holds this first.
inline std::mutex& hdf5_mutex() {
  static std::mutex mutex;
  return mutex;
}
// hdf5_mutex() held, by a thread at the normal scheduling class while it holds it: a
// background writer of the idle class (--checkpoint-async) that others wait on then runs
// as they would (priority inheritance by hand).
class Hdf5Lock {
 public:
  Hdf5Lock() : lock_(hdf5_mutex()) {
    pthread_getschedparam(pthread_self(), &policy_, &param_);
    if (policy_ != SCHED_OTHER) {
      const sched_param normal{};
      pthread_setschedparam(pthread_self(), SCHED_OTHER, &normal);
    }
  }
  ~Hdf5Lock() {
    if (policy_ != SCHED_OTHER) pthread_setschedparam(pthread_self(), policy_, &param_);
  }
  Hdf5Lock(const Hdf5Lock&) = delete;
  Hdf5Lock& operator=(const Hdf5Lock&) = delete;

 private:
  std::lock_guard<std::mutex> lock_;
  int policy_ = SCHED_OTHER;
  sched_param param_{};
};

}  // namespace mpipe
