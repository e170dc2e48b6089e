// The CUDA runtime of one rank: which GPU it drives, its streams (one for compute, one
// each way for copies) and library handles, and RAII device memory, pinned host memory
// and events. No CUDA header appears here, so host code compiled by g++ includes it in
// every build; src/backend/cuda/runtime.cu implements it, or
// src/backend/cuda_absent.cpp in a build without CUDA (which then reports no GPU).
// Plain C++17: CUDA sources include it too.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mpipe::cuda {

// Whether this build has the CUDA backend compiled in.
bool built();

// GPUs this process can use. 0 when there are none, with `why` (when given) saying
// why: not built with CUDA, no driver, no device, CUDA_VISIBLE_DEVICES empty, ...
int device_count(std::string* why = nullptr);

// Opens cuBLAS, cuBLASLt and cuDNN and finds every function the backend calls (init()
// does it; they are not linked, so a CPU run never loads them). Throws an Error naming
// the library or function that is missing. Needs no GPU.
void load_libraries();

struct DeviceProperties {
  std::string name;
  int major = 0, minor = 0;        // compute capability
  int multiprocessors = 0;
  std::size_t memory_bytes = 0;
};
DeviceProperties properties(int ordinal);

// Makes `ordinal` this process's GPU and creates the compute and copy streams and the
// cuBLAS, cuBLASLt and cuDNN handles. Once per process; later calls with the same
// ordinal do nothing.
void init(int ordinal);
bool active();       // init() has run
int device();        // the ordinal init() chose
// Makes init()'s GPU current on the calling thread: a helper thread (communication
// progress) through which a CUDA-aware MPI may touch device memory.
void bind_thread();

enum class StreamKind { compute, to_device, to_host };

// Waits for everything queued on one stream.
void synchronize(StreamKind kind);

// Asynchronous copies on a stream; host memory should be pinned for them to overlap.
void copy_to_device(void* device_dst, const void* host_src, std::size_t bytes, StreamKind on = StreamKind::compute);
void copy_to_host(void* host_dst, const void* device_src, std::size_t bytes, StreamKind on = StreamKind::compute);
void copy_on_device(void* dst, const void* src, std::size_t bytes);  // compute stream
void zero(void* device_dst, std::size_t bytes);                      // compute stream

// Raw device memory (cudaMalloc: 256-byte aligned). For the arena and the buffers below.
void* allocate(std::size_t bytes);
void release(void* device_ptr) noexcept;
// The most device memory this process held at once through allocate(), the ops' scratch
// and the cuBLASLt workspace (not the libraries' own allocations); 0 without a GPU.
std::size_t device_bytes_peak();

// Move-only owner of device memory (cudaMalloc, zeroed) or of page-locked host memory
// (cudaMallocHost): the staging area of copies that overlap compute, and of MPI
// messages when MPI is not CUDA-aware.
enum class Memory { device, pinned };
template <Memory kind>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t bytes);
  Buffer(Buffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      free();
      data_ = other.data_;
      bytes_ = other.bytes_;
      other.data_ = nullptr;
      other.bytes_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { free(); }
  void* data() const { return data_; }
  template <class T>
  T* as() const { return static_cast<T*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void free() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};
using DeviceBuffer = Buffer<Memory::device>;
using PinnedBuffer = Buffer<Memory::pinned>;
// Defined per kind in runtime.cu (or cuda_absent.cpp).
template <>
DeviceBuffer::Buffer(std::size_t bytes);
template <>
void DeviceBuffer::free() noexcept;
template <>
PinnedBuffer::Buffer(std::size_t bytes);
template <>
void PinnedBuffer::free() noexcept;

// Move-only CUDA event: marks a point in a stream; with timing, seconds_between() tells
// the GPU time between two of them (how the executor times actions without waiting).
class Event {
 public:
  explicit Event(bool timing = false);
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();
  void record(StreamKind on);
  bool done() const;          // everything before the record has run
  void synchronize() const;   // the host waits for it
  void wait(StreamKind on);   // `on` waits for it, the host does not
  // GPU seconds from `start` to `end`, both recorded with timing and both done.
  friend double seconds_between(const Event& start, const Event& end);

 private:
  void* event_ = nullptr;
};

double seconds_between(const Event& start, const Event& end);

// CUDA Graphs (train --cuda-graphs on): what the calling thread queues on the compute
// stream between begin_capture() and launch_captured() is recorded, not run, and then
// launched as one graph. Each graph is kept under a key (an action of one micro-batch):
// when the same action is recorded again (the next step), the graph made before is
// updated in place (cudaGraphExecUpdate: only kernel arguments and addresses differ),
// which costs far less than making it anew; a recording of another shape replaces it.
class GraphSet {
 public:
  explicit GraphSet(int keys = 0);
  GraphSet(const GraphSet&) = delete;
  GraphSet& operator=(const GraphSet&) = delete;
  ~GraphSet();
  void begin_capture();
  // Ends the recording and launches it on the compute stream as graph `key`. Throws an
  // Error naming what broke the recording (a call that cannot be recorded).
  void launch_captured(int key);
  // After an exception between begin_capture() and launch_captured(): ends the
  // recording and drops it (nothing of it runs).
  void abandon() noexcept;

 private:
  std::vector<void*> execs_;  // cudaGraphExec_t per key, or null
  bool capturing_ = false;
};

// Graph launches of this process: how many, how many graphs were made (the first of a
// key, or a recording whose shape changed), how many were updated in place, and the nodes
// (kernels, copies, memsets) the launched graphs held in all.
struct GraphCounts {
  std::int64_t launched = 0, made = 0, updated = 0, nodes = 0;
};
GraphCounts graph_counts();
// Whether the calling thread is recording the compute stream (GraphSet::begin_capture).
bool capturing();

}  // namespace mpipe::cuda
