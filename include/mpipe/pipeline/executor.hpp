// The executor: the one interpreter of lowered schedules, and the only code that
// touches both the communicators and the layers.
//
// Each rank runs one stage (a contiguous range of layers) of one replica. A step:
// zero gradients, draw this replica's share of the mini-batch, post every receive,
// walk the stage's action list (F, B, sends, receives), sum gradients over replicas
// in buckets started while the last backward still runs, sum tied-weight gradients
// between first and last stage, agree on the loss and the global gradient norm, clip,
// update. With one rank it is the plain single-process trainer.
//
// On a GPU (TrainConfig::device "cuda") the whole step stays in device memory: the
// batch is copied over once, activations and gradients go between stages straight from
// device memory when MPI is CUDA-aware, otherwise through pinned host buffers with the
// copies on their own streams, and a send is posted as soon as its data is ready while
// the next micro-batch computes. Compute actions are timed with CUDA events, so phase
// times, the bubble and traces show GPU time without the host waiting on each action.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/arena.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/optimizer.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/pipeline/grid.hpp"
#include "mpipe/pipeline/partition.hpp"
#include "mpipe/pipeline/schedule.hpp"

namespace mpipe {

struct PipelineConfig {
  GridShape grid;                  // --stages, --replicas (0: inferred), --rank-order
  std::string schedule = "gpipe";  // gpipe | 1f1b
  std::string remat = "never";     // always | except-last | never
  std::string partition = "flops"; // uniform | params | flops | time
  std::string balance;             // "a,b,..." layers per stage; overrides partition
  double p2p_timeout = 600.0;      // seconds a point-to-point wait may block
};

struct TrainConfig {
  ModelConfig model;
  OptimizerConfig optimizer;
  PipelineConfig pipeline;
  std::string data = "synthetic";
  int batch_size = 32;      // global mini-batch, in samples
  int micro_batches = 1;    // per replica
  int steps = 100;          // the step training runs up to
  std::uint64_t seed = 1;
  int threads = 0;          // 0: every core the process may use
  int log_every = 10;
  std::string metrics;      // JSON-lines file, or empty
  std::string summary;      // JSON summary written at the end, or empty
  std::string trace;        // Chrome/Perfetto trace of every rank's actions, or empty
  int trace_steps = 5;      // steps traced, after the first
  std::string checkpoint_dir;    // where checkpoints go; empty: none
  int checkpoint_every = 0;      // steps between checkpoints; 0: only the final one
  int keep = 0;                  // complete checkpoints kept; 0: all
  std::string resume = "auto";   // auto | never | PATH
  std::string device = "cpu";    // cpu | cuda | auto; resolve_device() turns auto into one
  std::string precision = "fp32";  // fp32 | bf16 (GPU): compute and message precision
};

// Collective over `world`: resolves config.device ("auto": CUDA when every rank has a
// GPU), binds each rank to GPU (node-local rank modulo visible GPUs) and initialises it.
// UserError, agreed on every rank, when "cuda" is asked for and some rank has no usable
// GPU, or bf16 is asked for on the CPU. Returns a line describing the choice.
std::string resolve_device(TrainConfig& config, const Communicator& world);

// Checks everything that needs no communication; UserError on a problem. `world` is
// the number of ranks, or 0 when not known yet.
void validate(const TrainConfig& config, int world = 0);

struct StepResult {
  std::int64_t step = 0;
  double loss = 0.0;            // mean over the mini-batch's loss rows
  double grad_norm = 0.0;       // global, before clipping
  float lr = 0.0f;
  bool skipped = false;         // non-finite loss or gradients: no update anywhere
  double seconds = 0.0;
  double bubble_fraction = 0.0; // measured, averaged over ranks
  bool stop = false;            // some rank asked to stop after this step
};

// One timed action of one rank, for --trace. Plain data: gathered with MPI as bytes.
struct TraceEvent {
  enum Kind : std::int16_t { forward, backward, recompute, send_act, recv_act, send_grad, recv_grad, send_wait,
                             allreduce, optimizer, count };
  static const char* name(int kind);
  double start = 0, end = 0;  // seconds since the run's common start
  std::int32_t step = 0;
  std::int16_t kind = 0;
  std::int16_t micro_batch = -1;
};

// Seconds one rank spent in each phase of a step.
struct PhaseTimes {
  static constexpr int count = 8;
  static const char* name(int i);
  double forward = 0, backward = 0, recompute = 0, p2p_wait = 0, allreduce = 0, optimizer = 0, idle = 0, step = 0;
  double operator[](int i) const {
    const double all[count] = {forward, backward, recompute, p2p_wait, allreduce, optimizer, idle, step};
    return all[i];
  }
};

class Executor {
 public:
  // Three phases so that a failure on one rank never leaves another in a collective:
  // the constructor does only local work (validation, the model); connect() is
  // collective (grid, partition); allocate() is local again (parameters, data, buffers).
  Executor(const TrainConfig& config, const Communicator& world);
  void connect();
  void allocate();
  ~Executor();

  StepResult step(std::int64_t step);
  // Forward and backward over the mini-batch of `step` with every gradient reduction
  // (replicas, tied weights) but no update; returns the mean loss.
  double compute_gradients(std::int64_t step);

  const TrainConfig& config() const { return config_; }
  const Grid& grid() const { return *grid_; }
  const Partition& partition() const { return partition_; }
  const Schedule& schedule() const { return schedule_; }
  Model& model() { return model_; }
  ParamStore& params() { return *params_; }
  Optimizer& optimizer() { return *optimizer_; }
  // Optimizer updates made so far (Adam's t); a checkpoint carries it.
  std::int64_t updates() const { return updates_; }
  void set_updates(std::int64_t updates) { updates_ = updates; }
  // A stop (preemption) asked for on this rank; step() agrees on it over every rank and
  // reports it in StepResult::stop.
  void request_stop() { stop_requested_ = true; }
  const Dataset* dataset() const { return dataset_.get(); }
  const Arena& arena() const { return *persistent_; }
  Device device() const { return device_; }
  bool cuda_aware() const { return cuda_aware_; }
  // GPU only: training state to the host mirrors (before a checkpoint) and back (after
  // loading one). No-ops on the CPU.
  void download_state();
  void upload_state();
  const PhaseTimes& last_times() const { return times_; }
  // Peak bytes of activations and scratch held by this rank so far.
  std::size_t peak_activation_bytes() const;
  // The events recorded for --trace (steps 1 .. trace_steps); times from trace_origin().
  const std::vector<TraceEvent>& trace_events() const { return trace_; }
  // Collective: sets a common time origin on every rank (after a barrier).
  void start_trace_clock();

 private:
  struct Bucket {
    int lowest_layer;          // starts when this layer's last backward is done
    std::size_t begin, end;    // span of the gradient buffer
  };
  StepResult step_unchecked(std::int64_t step);
  Pass make_pass(std::int64_t step, int micro_batch, Arena* arena) const;
  bool rematerialize(int micro_batch) const;
  void run_forward(std::int64_t step, int micro_batch);
  void run_backward(std::int64_t step, int micro_batch);
  Context* forward_layers(const Pass& pass, int micro_batch, Tensor* output);
  void reduce_gradients();
  void run_pipeline(std::int64_t step);
  void allocate_messages();
  void queue_send(const Tensor& data, int which, int micro_batch, int peer, int tag);
  void post_ready_sends(bool wait);
  void finish_receive(int which, int micro_batch);
  void begin_compute(int kind, int micro_batch);
  void end_compute();
  void resolve_gpu_times(std::int64_t step);

  TrainConfig config_;
  const Communicator& world_;
  Model model_;
  std::unique_ptr<Grid> grid_;
  Partition partition_;
  Schedule schedule_;
  int begin_ = 0, end_ = 0;  // this stage's layers
  int micro_ = 0;            // samples per micro-batch
  std::vector<Shape> shapes_;
  Device device_ = Device::cpu;
  DType dtype_ = DType::f32;  // of activations, their gradients and the messages
  bool cuda_aware_ = false;
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Dataset> dataset_;
  std::unique_ptr<Arena> persistent_, scratch_;
  // One micro-batch's incoming activation or gradient.
  struct Message {
    FloatBuffer host;              // CPU training
    cuda::DeviceBuffer device;     // GPU training
    cuda::PinnedBuffer staging;    // GPU training when MPI is not CUDA-aware
    Tensor tensor;                 // what the layers read
    std::span<std::byte> wire;     // what MPI receives into
  };
  std::vector<Message> recv_act_, recv_grad_;      // [micro-batch]
  // GPU: per micro-batch and direction (0 activation, 1 gradient), the staging buffer
  // of an outgoing message and the event marking its data ready; the events that order
  // a received message's copy before its use.
  std::vector<cuda::PinnedBuffer> send_staging_[2];
  std::vector<cuda::Event> send_ready_[2], recv_ready_[2];
  struct PendingSend {
    cuda::Event* ready;
    std::span<const std::byte> wire;
    int peer, tag;
  };
  std::vector<PendingSend> pending_sends_;         // queued, not yet posted; in order
  cuda::PinnedBuffer batch_host_;                  // GPU: the batch on the host, pinned
  cuda::DeviceBuffer batch_device_;
  Tensor device_inputs_, device_targets_;
  cuda::DeviceBuffer device_loss_;                 // one double: the step's summed loss
  cuda::PinnedBuffer host_loss_;
  cuda::PinnedBuffer grad_staging_;                // reductions when MPI is not CUDA-aware
  // GPU timing: marks_[0] at the step's start, then two per compute action.
  struct ComputeMark {
    int kind, micro_batch;
  };
  std::vector<cuda::Event> marks_;
  std::vector<ComputeMark> compute_marks_;
  std::chrono::steady_clock::time_point gpu_origin_;
  std::vector<MPI_Request> recv_act_req_, recv_grad_req_, send_req_, bucket_req_;
  std::vector<Tensor> outputs_, input_grads_;      // [micro-batch], in persistent_
  std::vector<Context*> contexts_;                 // [micro-batch], null when rematerialized
  std::vector<Bucket> buckets_;
  std::vector<std::pair<std::size_t, std::size_t>> tied_spans_;  // (offset, count) of gradients
  std::vector<double> reduce_buffer_;              // per-layer norms, loss, bubble
  std::unique_ptr<std::byte[]> batch_memory_;
  Tensor inputs_, targets_;                        // this replica's share of the batch
  double loss_sum_ = 0.0;
  std::int64_t updates_ = 0;
  PhaseTimes times_;
  int fail_rank_ = -1, fail_step_ = -1;            // MPIPE_TEST_FAIL=RANK:STEP[:stall]
  bool fail_stall_ = false;
  bool stop_requested_ = false;
  std::vector<TraceEvent> trace_;                  // reserved once; never grows in a step
  std::chrono::steady_clock::time_point trace_origin_;
  bool tracing(std::int64_t step) const {
    return !config_.trace.empty() && step >= 1 && step <= config_.trace_steps && trace_.size() < trace_.capacity();
  }
  void record(std::int64_t step, int kind, int micro_batch, std::chrono::steady_clock::time_point start);
};

}  // namespace mpipe
