// CUDA Graphs of the compute stream (runtime.hpp's GraphSet): an action's kernels recorded
// as the host code runs them, launched as one graph, and the graph updated in place when
// the next step records the same action.
#include <atomic>
#include <cstdio>

#include "context.cuh"

namespace mpipe::cuda {

namespace {
std::atomic<std::int64_t> g_launched{0}, g_made{0}, g_updated{0}, g_nodes{0};
thread_local bool t_capturing = false;

void destroy(void* exec) noexcept {
  if (exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}
}  // namespace

GraphCounts graph_counts() { return {g_launched.load(), g_made.load(), g_updated.load(), g_nodes.load()}; }
bool capturing() { return t_capturing; }

GraphSet::GraphSet(int keys) : execs_(static_cast<std::size_t>(keys), nullptr) {}
GraphSet::~GraphSet() {
  abandon();
  for (void* e : execs_) destroy(e);
}

void GraphSet::begin_capture() {
  MPIPE_CHECK(!capturing_ && !t_capturing, "a CUDA graph recording began inside another");
  // Relaxed: this thread may still call what could synchronise elsewhere (MPI's tests
  // between layers, an event query); the kernels queued on the compute stream are what
  // the graph records. Other threads queue nothing there.
  CUDA_CHECK(cudaStreamBeginCapture(context().compute, cudaStreamCaptureModeRelaxed));
  capturing_ = t_capturing = true;
}

void GraphSet::launch_captured(int key) {
  MPIPE_CHECK(capturing_, "launch_captured without begin_capture");
  cudaStream_t s = context().compute;
  cudaGraph_t graph = nullptr;
  capturing_ = t_capturing = false;
  const cudaError_t ended = cudaStreamEndCapture(s, &graph);  // first: no check below leaves the stream recording
  if (ended != cudaSuccess) {
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    throw Error(cat("recording the step's kernels as a CUDA graph failed (", cudaGetErrorString(ended),
                    "): an op called something a graph cannot hold; run with --cuda-graphs off, and report it"));
  }
  if (key < 0 || static_cast<std::size_t>(key) >= execs_.size()) {
    cudaGraphDestroy(graph);
    throw Error(cat("CUDA graph key ", key, " of ", execs_.size()));
  }
  std::size_t nodes = 0;
  CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  g_nodes += static_cast<std::int64_t>(nodes);
  void*& exec = execs_[static_cast<std::size_t>(key)];
  if (exec) {
    // The same action as last step: the same kernels in the same order, with this step's
    // arguments (the dropout's step, addresses). Anything else fails the update, and the
    // graph is made anew (said once a process: an action remade every step costs its
    // instantiation each time).
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(static_cast<cudaGraphExec_t>(exec), graph, &info) == cudaSuccess) {
      ++g_updated;
    } else {
      cudaGetLastError();
      static std::atomic<bool> said{false};
      if (!said.exchange(true))
        std::fprintf(stderr, "mpipe: a CUDA graph (action %d) could not be updated in place (cudaGraphExecUpdateResult %d); "
                     "it is made anew\n", key, static_cast<int>(info.result));
      destroy(exec);
      exec = nullptr;
    }
  }
  if (!exec) {
    cudaGraphExec_t made = nullptr;
    const cudaError_t status = cudaGraphInstantiate(&made, graph, 0);
    if (status != cudaSuccess) cudaGraphDestroy(graph);
    CUDA_CHECK(status);
    exec = made;
    ++g_made;
  }
  cudaGraphDestroy(graph);
  CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), s));
  ++g_launched;
}

void GraphSet::abandon() noexcept {
  if (!capturing_) return;
  capturing_ = t_capturing = false;
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(context().compute, &graph);
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
}

}  // namespace mpipe::cuda
