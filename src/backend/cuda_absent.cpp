// The CUDA runtime in a build without CUDA (MPIPE_CUDA=OFF, or no nvcc found): it
// reports no GPU, so --device auto picks the CPU and --device cuda is refused with a
// hint. Nothing here is reachable once device_count() has said 0; each entry point
// still says plainly what happened if a caller forgets to ask.
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe::cuda {

namespace {
[[noreturn]] void not_built() {
  throw Error("this mpipe was built without the CUDA backend (MPIPE_CUDA=OFF or no nvcc at configure time)");
}
}  // namespace

bool built() { return false; }
int device_count(std::string* why) {
  if (why) *why = "this mpipe was built without CUDA";
  return 0;
}
void load_libraries() { not_built(); }
DeviceProperties properties(int) { not_built(); }
void init(int) { not_built(); }
bool active() { return false; }
int device() { return -1; }
void bind_thread() {}
void synchronize(StreamKind) { not_built(); }
void copy_to_device(void*, const void*, std::size_t, StreamKind) { not_built(); }
void copy_to_host(void*, const void*, std::size_t, StreamKind) { not_built(); }
void copy_on_device(void*, const void*, std::size_t) { not_built(); }
void zero(void*, std::size_t) { not_built(); }
void* allocate(std::size_t) { not_built(); }
void release(void*) noexcept {}
std::size_t device_bytes_peak() { return 0; }
template <>
DeviceBuffer::Buffer(std::size_t) { not_built(); }
template <>
void DeviceBuffer::free() noexcept {}
template <>
PinnedBuffer::Buffer(std::size_t) { not_built(); }
template <>
void PinnedBuffer::free() noexcept {}
Event::Event(bool) { not_built(); }
double seconds_between(const Event&, const Event&) { not_built(); }
Event::Event(Event&&) noexcept {}
Event& Event::operator=(Event&&) noexcept { return *this; }
Event::~Event() = default;
void Event::record(StreamKind) { not_built(); }
bool Event::done() const { not_built(); }
void Event::synchronize() const { not_built(); }
void Event::wait(StreamKind) { not_built(); }
GraphSet::GraphSet(int) {}
GraphSet::~GraphSet() = default;
void GraphSet::begin_capture() { not_built(); }
void GraphSet::launch_captured(int) { not_built(); }
void GraphSet::abandon() noexcept {}
GraphCounts graph_counts() { return {}; }
bool capturing() { return false; }

}  // namespace mpipe::cuda
