// The rank's GPU: device choice, streams, library handles, memory, events, copies.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "context.cuh"

namespace mpipe::cuda {

namespace {
// The device memory this process allocated through us (arenas, buffers, scratch, the
// cuBLASLt workspace), and the most it held at once: what --summary reports beside
// PyTorch's max_memory_allocated. Library-internal allocations are not counted.
struct Ledger {
  std::mutex mutex;
  std::unordered_map<void*, std::size_t> sizes;
  std::size_t in_use = 0, peak = 0;
};
Ledger& ledger() {
  static Ledger* l = new Ledger;  // never destroyed: buffers may be freed at exit
  return *l;
}
void counted(void* p, std::size_t bytes) {
  Ledger& l = ledger();
  const std::lock_guard<std::mutex> lock(l.mutex);
  l.sizes[p] = bytes;
  l.in_use += bytes;
  l.peak = std::max(l.peak, l.in_use);
}
void uncounted(void* p) {
  Ledger& l = ledger();
  const std::lock_guard<std::mutex> lock(l.mutex);
  const auto it = l.sizes.find(p);
  if (it == l.sizes.end()) return;
  l.in_use -= it->second;
  l.sizes.erase(it);
}
}  // namespace

std::size_t device_bytes_peak() {
  Ledger& l = ledger();
  const std::lock_guard<std::mutex> lock(l.mutex);
  return l.peak;
}


void fail(const char* file, int line, const char* call, const std::string& what) {
  throw Error(cat(file, ":", line, ": `", call, "` failed: ", what));
}

const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED (out of GPU memory)";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
  }
}

namespace {

Context g_context;
bool g_active = false;

}  // namespace

bool built() { return true; }

int device_count(std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    // Without NVIDIA's kernel driver the runtime reports an "insufficient driver version",
    // which reads as an upgrade to make: on a node without a GPU there is no driver at all.
    std::FILE* driver = std::fopen("/proc/driver/nvidia/version", "r");
    if (driver) std::fclose(driver);
    if (why)
      *why = driver ? cat("cudaGetDeviceCount: ", cudaGetErrorString(status))
                    : std::string("no NVIDIA driver on this node (no /proc/driver/nvidia/version): no GPU here");
    return 0;
  }
  if (count == 0 && why) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    *why = visible ? cat("no GPU visible (CUDA_VISIBLE_DEVICES='", visible, "')") : std::string("no GPU found");
  }
  return count;
}

DeviceProperties properties(int ordinal) {
  cudaDeviceProp p{};
  CUDA_CHECK(cudaGetDeviceProperties(&p, ordinal));
  DeviceProperties out;
  out.name = p.name;
  out.major = p.major;
  out.minor = p.minor;
  out.multiprocessors = p.multiProcessorCount;
  out.memory_bytes = p.totalGlobalMem;
  return out;
}

void init(int ordinal) {
  if (g_active) {
    MPIPE_CHECK(g_context.device == ordinal, "cuda::init(", ordinal, ") after init(", g_context.device, ")");
    return;
  }
  Context& c = g_context;
  c.device = ordinal;
  CUDA_CHECK(cudaSetDevice(ordinal));
  CUDA_CHECK(cudaGetDeviceProperties(&c.properties, ordinal));
  // Non-blocking: the legacy default stream, which MPI libraries may use, never
  // serialises with ours.
  CUDA_CHECK(cudaStreamCreateWithFlags(&c.compute, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&c.to_device, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&c.to_host, cudaStreamNonBlocking));
  CUBLAS_CHECK(lib().cublasCreate(&c.blas));
  CUBLAS_CHECK(lib().cublasSetStream(c.blas, c.compute));
  // No atomics: the same call gives the same bits (cuBLAS's reproducibility rule).
  CUBLAS_CHECK(lib().cublasSetAtomicsMode(c.blas, CUBLAS_ATOMICS_NOT_ALLOWED));
  CUBLAS_CHECK(lib().cublasLtCreate(&c.blas_lt));
  // 32 MiB is what cuBLAS asks for on Hopper to reach its fastest kernels.
  c.lt_workspace_bytes = std::size_t{32} << 20;
  CUDA_CHECK(cudaMalloc(&c.lt_workspace, c.lt_workspace_bytes));
  counted(c.lt_workspace, c.lt_workspace_bytes);
  CUBLAS_CHECK(lib().cublasSetWorkspace(c.blas, c.lt_workspace, c.lt_workspace_bytes));
  CUDNN_CHECK(lib().cudnnCreate(&c.dnn));
  CUDNN_CHECK(lib().cudnnSetStream(c.dnn, c.compute));
  g_active = true;
}

bool active() { return g_active; }
int device() { return g_active ? g_context.device : -1; }
void bind_thread() {
  if (g_active) CUDA_CHECK(cudaSetDevice(g_context.device));
}

Context& context() {
  MPIPE_CHECK(g_active, "the CUDA backend is used before cuda::init()");
  return g_context;
}

namespace {
// A wait inside a CUDA graph's recording would end it with CUDA's own error; this names
// the flag instead.
void not_while_recording(const char* what) {
  if (capturing())
    throw Error(cat(what, " while a CUDA graph was recorded; run with --cuda-graphs off, and report it"));
}
}  // namespace

void* scratch(std::size_t bytes) {
  Context& c = context();
  if (bytes > c.scratch_bytes) {
    // A graph being recorded holds the old scratch's address, and the stream cannot be
    // waited for: the steps before the first graphed one size it (Stage::graphed).
    not_while_recording("an op's scratch memory grew");
    CUDA_CHECK(cudaStreamSynchronize(c.compute));  // the old scratch may still be in use
    if (c.scratch) {
      uncounted(c.scratch);
      CUDA_CHECK(cudaFree(c.scratch));
    }
    // Nothing held until the new region is: a failed grow leaves no stale size behind.
    c.scratch = nullptr;
    c.scratch_bytes = 0;
    const std::size_t grown = bytes + bytes / 8;
    c.scratch = allocate(grown);  // counted; out of memory: allocate()'s error
    c.scratch_bytes = grown;
  }
  return c.scratch;
}

void synchronize(StreamKind kind) {
  not_while_recording("the host waited for the GPU");
  CUDA_CHECK(cudaStreamSynchronize(stream(kind)));
}

void copy_to_device(void* dst, const void* src, std::size_t bytes, StreamKind on) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream(on)));
}
void copy_to_host(void* dst, const void* src, std::size_t bytes, StreamKind on) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream(on)));
}
void copy_on_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, context().compute));
}
void zero(void* dst, std::size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, context().compute));
}

void* allocate(std::size_t bytes) {
  void* p = nullptr;
  const cudaError_t status = cudaMalloc(&p, bytes ? bytes : 1);
  if (status != cudaSuccess) {
    cudaGetLastError();
    std::size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    throw Error(cat("out of GPU memory allocating ", bytes >> 20, " MiB (", free_bytes >> 20, " of ", total >> 20,
                    " MiB free); try more --stages, --remat always or more --micro-batches"));
  }
  counted(p, bytes);
  return p;
}
void release(void* p) noexcept {
  if (!p) return;
  uncounted(p);
  cudaFree(p);
}

// ---- RAII owners -------------------------------------------------------------------

template <>
DeviceBuffer::Buffer(std::size_t bytes) : data_((not_while_recording("device memory was allocated"), allocate(bytes))), bytes_(bytes) {
  // Zeroed on our compute stream and waited for: plain cudaMemset would run on the
  // legacy stream, which our non-blocking streams do not wait for. Buffers are made
  // at set-up, so the wait costs nothing in a step.
  cudaStream_t s = context().compute;
  CUDA_CHECK(cudaMemsetAsync(data_, 0, bytes ? bytes : 1, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
}
template <>
void DeviceBuffer::free() noexcept {
  release(data_);
}

template <>
PinnedBuffer::Buffer(std::size_t bytes) : bytes_(bytes) {
  CUDA_CHECK(cudaMallocHost(&data_, bytes ? bytes : 1));
}
template <>
void PinnedBuffer::free() noexcept {
  if (data_) cudaFreeHost(data_);
}

Event::Event(bool timing) {
  cudaEvent_t e;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  event_ = e;
}

double seconds_between(const Event& start, const Event& end) {
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_), static_cast<cudaEvent_t>(end.event_)));
  return 1e-3 * static_cast<double>(ms);
}
Event::Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}
Event::~Event() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}
void Event::record(StreamKind on) { CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), stream(on))); }
bool Event::done() const {
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (status == cudaErrorNotReady) return false;
  CUDA_CHECK(status);
  return true;
}
void Event::synchronize() const { CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_))); }
void Event::wait(StreamKind on) { CUDA_CHECK(cudaStreamWaitEvent(stream(on), static_cast<cudaEvent_t>(event_), 0)); }


}  // namespace mpipe::cuda
