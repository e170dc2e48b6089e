// Gradient sums over replicas and tied weights, the step's agreement, and the running
// statistics over replicas.
#include "mpipe/pipeline/comm/reducer.hpp"

#include <algorithm>

#include "mpipe/backend/ops.hpp"
#include "mpipe/nn/optimizer.hpp"

namespace mpipe {

Reducer::Reducer(const Grid& grid, Model& model, const Partition& partition, ParamStore& params,
                 std::vector<int> layers, const StepDevice& device, bool deferred_batchnorm, bool shard_optimizer,
                 double timeout_s)
    : grid_(grid), model_(model), params_(params), device_(device), deferred_batchnorm_(deferred_batchnorm),
      timeout_(timeout_s) {
  const int K = grid.stages(), D = grid.replicas();
  // One bucket per layer with parameters, from the last layer down: gradients become
  // final in that order during the last micro-batch's backward. Whole layers, and never
  // more than one, so every message is the same whatever K is: MPI's reduction order
  // may depend on the message size, and promise 1 must hold for any D too.
  if (D > 1) {
    const auto entries = params_.entries();
    std::size_t hi = params_.grads().size();
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      const int layer = *it;
      std::size_t lo = hi;
      for (const ParamEntry& e : entries)
        if (e.layer == layer) lo = std::min(lo, e.offset);
      if (lo < hi) {
        buckets_.push_back({layer, lo, hi});
        hi = lo;
      }
    }
  }
  MPIPE_CHECK(2 * buckets_.size() < 32767, "more gradient buckets than MPI tags: ", buckets_.size());
  // The sharded optimizer's pieces (as Optimizer's: trained views, not aliases), each
  // sent to every other replica and received from its owner.
  if (shard_optimizer && D > 1) {
    const int mine = grid.replica();
    MPIPE_CHECK(grid.data().rank() == mine && grid.data().size() == D, "replica group ", grid.data().rank(), " of ",
                grid.data().size(), " for replica ", mine, " of ", D);
    const auto entries = params_.entries();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const ParamEntry& e = entries[i];
      if (e.alias || e.buffer) continue;
      for (int part = 0; part < D; ++part) {
        const auto [first, last] = shard_elements(e.shape, part, D);
        if (first == last) continue;
        const int tag = static_cast<int>(i);
        if (part == mine) {
          for (int peer = 0; peer < D; ++peer)
            if (peer != mine)
              sends_.push_back({e.layer, e.param_offset + first, last - first, peer, tag,
                                cat("the updated values sent to replica ", peer, " of layer")});
        } else {
          receives_.push_back({e.layer, e.param_offset + first, last - first, part, tag,
                               cat("replica ", part, "'s updated values of layer")});
        }
      }
    }
    MPIPE_CHECK(entries.size() <= 32767, "more parameter views than MPI tags: ", entries.size());
  }
  gather_tickets_.assign(sends_.size() + receives_.size(), Progress::none);
  bucket_of_.assign(static_cast<std::size_t>(model_.size()), -1);
  for (std::size_t b = 0; b < buckets_.size(); ++b) bucket_of_[static_cast<std::size_t>(buckets_[b].lowest_layer)] = static_cast<int>(b);

  // Tied weights split over stages: each copy held apart from its owner sums its
  // gradient with the owner's rows it is, one exchange per tie between the two stages.
  // Every rank lists its spans in entry order and tags them with the tie's index, so
  // the two ranks of a tie agree (an alias copy is summed locally).
  if (K > 1) {
    const auto& ties = model_.ties();
    auto holds = [&](int layer) { return std::find(layers.begin(), layers.end(), layer) != layers.end(); };
    auto stage_of = [&](int layer) { return partition.pipeline_stage(partition.stage_of(layer)); };
    for (const ParamEntry& e : params_.entries()) {
      for (std::size_t t = 0; t < ties.size(); ++t) {
        const Model::Tie& tie = ties[t];
        const bool copy_here = e.tied_copy && !e.alias && tie.copy_layer == e.layer;
        const bool owner_here = !e.tied_copy && tie.owner_layer == e.layer && tie.name == e.name && !holds(tie.copy_layer);
        if (!copy_here && !owner_here) continue;
        MPIPE_CHECK(!grid_.tied().null(), "stage ", grid_.stage(), " holds a tied weight but no tied group");
        const std::size_t row = static_cast<std::size_t>(e.numel() / e.shape[0]);
        const std::size_t offset = copy_here ? e.offset : e.offset + static_cast<std::size_t>(tie.rows_begin) * row;
        const std::size_t count = static_cast<std::size_t>(tie.rows_end - tie.rows_begin) * row;
        tied_spans_.push_back({e.layer, offset, count, stage_of(copy_here ? tie.owner_layer : tie.copy_layer),
                               static_cast<int>(t), nullptr});
      }
    }
  }
  // With one replica a tied sum starts as soon as its layer's gradient is final, and
  // moves while the rest of the backward runs. With replicas it follows the replica sum
  // of its bucket (one summation order for every K and D). On a GPU it starts after
  // the backward, which need not wait for the GPU midway.
  tied_early_ = D == 1 && device_.kind() == Device::cpu;
  // Without CUDA-aware MPI, replica sums go through a pinned host copy.
  if (device_.staged() && !buckets_.empty()) grad_staging_ = cuda::PinnedBuffer(params_.grads().size() * sizeof(float));
  done_.reserve(buckets_.size() + tied_spans_.size());
  agree_buffer_.assign(static_cast<std::size_t>(model_.size() + 4 + grid_.world().size()), 0.0);

  std::vector<Layer*> parts;
  for (const int i : layers) model_.layer(i).parts(parts);
  std::size_t sums = 0, buffers = 0;
  for (Layer* part : parts)
    if (!part->step_sums().empty()) {
      deferred_.push_back(part);
      sums += part->step_sums().size();
    }
  for (const ParamEntry& e : params_.entries())
    if (e.buffer) buffers += static_cast<std::size_t>(e.numel());
  settle_sums_.assign(sums, 0.0);  // sized once: nothing in the step allocates
  settle_values_.assign(buffers, 0.0f);
}

int Reducer::requests() const {
  // The buckets, the tied sums' two messages each, the closing allreduce and the
  // running statistics' sum.
  int tied = 0;
  for (const TiedSpan& t : tied_spans_) tied += PairSum::requests(t.count);
  return static_cast<int>(buckets_.size()) * GroupSum::requests(grid_.replicas()) + tied +
         static_cast<int>(gather_tickets_.size()) + 2;
}

// The values the layers read are the master's (the CPU, fp32 on a GPU) or a compute copy
// made from it; MPI moves the master itself where it can read device memory, else the
// host mirror: this replica's rows copied down before, the others' up after.
void Reducer::start_gather(std::int64_t update) {
  if (gather_tickets_.empty()) return;
  MPIPE_CHECK(!gathering_, "a gather is already in flight, update ", update);
  std::span<float> values = params_.master();
  if (device_.staged()) {
    values = params_.params();
    for (std::size_t i = 0; i < sends_.size(); ++i)
      if (i == 0 || sends_[i].offset != sends_[i - 1].offset)  // each piece once (it goes to every peer)
        cuda::copy_to_host(values.data() + sends_[i].offset, params_.master().data() + sends_[i].offset,
                           sends_[i].count * sizeof(float));
  }
  device_.synchronize();  // MPI reads the updated values now
  const Communicator& data = grid_.data();
  const auto bytes = [&](const Exchange& x) { return std::as_writable_bytes(values.subspan(x.offset, x.count)); };
  std::size_t t = 0;
  for (const Exchange& x : receives_) gather_tickets_[t++] = progress_->track(data.irecv(bytes(x), x.peer, x.tag), true, false);
  for (const Exchange& x : sends_) gather_tickets_[t++] = progress_->track(data.isend(bytes(x), x.peer, x.tag), true, false);
  progress_->wake();  // once for them all
  gathering_ = true;
}

void Reducer::finish_gather() {
  if (!gathering_) return;
  gathering_ = false;
  std::size_t t = 0;
  for (const Exchange& x : receives_) {
    Progress::Ticket& ticket = gather_tickets_[t++];
    progress_->wait(ticket, timeout_, x.what.c_str(), x.layer, static_cast<long>(x.count * sizeof(float)));
  }
  for (const Exchange& x : sends_) {
    Progress::Ticket& ticket = gather_tickets_[t++];
    progress_->wait(ticket, timeout_, x.what.c_str(), x.layer);
  }
  if (device_.staged())
    for (const Exchange& x : receives_)
      cuda::copy_to_device(params_.master().data() + x.offset, params_.params().data() + x.offset, x.count * sizeof(float));
  if (device_.kind() == Device::cuda) params_.refresh_compute_copy();  // bf16: from the gathered master
}

void Reducer::connect(Progress& progress) {
  progress_ = &progress;
  // Each bucket's sum over the gradients themselves, or over their pinned host copy
  // (reduced there, all at once, in reduce()). Bucket b's messages take tags 2b and 2b + 1
  // on the replica group, whose only other messages, --shard-optimizer's gather (tags:
  // entry indices), begin and end within an update, after reduce() has waited for every
  // bucket.
  const std::span<float> grads =
      device_.staged() && !buckets_.empty() ? std::span<float>(grad_staging_.as<float>(), params_.grads().size()) : params_.grads();
  const MessagePath path = device_.staged() ? MessagePath{} : device_.path();
  bucket_sums_.clear();
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    bucket_sums_.push_back(std::make_unique<GroupSum>(grid_.data(), progress, path,
                                                      grads.subspan(buckets_[b].begin, buckets_[b].end - buckets_[b].begin),
                                                      2 * static_cast<int>(b)));
  for (TiedSpan& t : tied_spans_)
    t.sum = std::make_unique<PairSum>(grid_.tied(), grid_.tied_rank(t.partner_stage), progress, device_.path(),
                                      params_.grads().subspan(t.offset, t.count), t.tag);
}

void Reducer::begin_step() {
  for (TiedSpan& t : tied_spans_) t.sum->post_receive();
}

void Reducer::clear_step_sums() {
  for (Layer* layer : deferred_) layer->clear_step_sums();  // a step's sums begin with its forward
}

// Start the replica sum (the layer's bucket) and tied sums this layer completes, so that
// they move while the rest of the backward runs. Layers complete in the order the
// schedule finishes them, which across a rank's model stages is any order (zbv's lower
// stage may run its last W first): every replica of the stage runs the same schedule, so
// the sums are posted in the same order on each. On a GPU without CUDA-aware MPI they go
// together, from a host copy, in reduce().
void Reducer::gradients_final(int layer) {
  const int b = bucket_of_[static_cast<std::size_t>(layer)];
  if (b >= 0 && !device_.staged() && !bucket_sums_[static_cast<std::size_t>(b)]->started()) {
    device_.synchronize();  // MPI reads the gradients now
    bucket_sums_[static_cast<std::size_t>(b)]->start();
  }
  // Sums whose first phase has arrived send their chunks' totals.
  for (const auto& sum : bucket_sums_) sum->advance();
  if (!tied_early_) return;
  for (TiedSpan& t : tied_spans_)
    if (t.layer == layer) t.sum->start();
}

void Reducer::reduce() {
  done_.clear();
  const std::span<float> grads = params_.grads();
  auto wait_buckets = [&] {
    for (std::size_t i = 0; i < buckets_.size(); ++i) {
      for (std::size_t j = i + 1; j < buckets_.size(); ++j) bucket_sums_[j]->advance();  // theirs move meanwhile
      done_.push_back({Sum::replicas, buckets_[i].lowest_layer,
                       bucket_sums_[i]->finish(timeout_, "the gradient sum over replicas of layer",
                                               buckets_[i].lowest_layer)});
    }
  };
  if (device_.staged() && !buckets_.empty()) {
    // The same buckets as everywhere else (promise 1), reduced from a pinned copy.
    const std::span<float> host(grad_staging_.as<float>(), grads.size());
    cuda::copy_to_host(host.data(), grads.data(), grads.size_bytes());
    device_.synchronize();
    for (const auto& sum : bucket_sums_) sum->start();
    wait_buckets();
    cuda::copy_to_device(grads.data(), host.data(), grads.size_bytes());
  } else {
    // A layer that no gradients_final() named (none today) is summed now, never skipped.
    bool synchronized = false;
    for (std::size_t i = 0; i < buckets_.size(); ++i)
      if (!bucket_sums_[i]->started()) {
        if (!synchronized) device_.synchronize();
        synchronized = true;
        bucket_sums_[i]->start();
      }
    wait_buckets();
  }
  // Tied weights: owner and copy end with the sum of both, after the replica sums. All
  // spans go at once; then each is waited on and added.
  params_.sum_local_tied_grads();
  for (TiedSpan& t : tied_spans_)
    if (!t.sum->started()) t.sum->start();
  for (TiedSpan& t : tied_spans_)
    done_.push_back({Sum::tied, t.layer, t.sum->finish(timeout_, "the tied-weight gradient sum of layer", t.layer)});
}

void Reducer::start_agree(double loss_sum, double busy, double pipeline, bool stop, bool time_limit) {
  MPIPE_CHECK(!agreeing(), "an agreement is already in flight");
  const int L = model_.size();
  std::fill(agree_buffer_.begin(), agree_buffer_.end(), 0.0);
  std::span<double> per_layer(agree_buffer_.data(), static_cast<std::size_t>(L));
  if (grid_.replica() == 0) params_.grad_sum_squares(per_layer);
  agree_buffer_[L] = loss_sum;
  agree_buffer_[L + 1] = busy;
  agree_buffer_[L + 2] = stop ? 1.0 : 0.0;
  agree_buffer_[L + 3] = time_limit ? 1.0 : 0.0;
  agree_buffer_[static_cast<std::size_t>(L + 4 + grid_.world().rank())] = pipeline;  // one entry per rank
  // Non-blocking and waited on through Progress: a rank that finished early blocks
  // instead of spinning in MPI while its neighbour still computes.
  agree_ticket_ = progress_->track(grid_.world().iallreduce(std::span<double>(agree_buffer_), Reduce::sum), false);
}

Reducer::Agreed Reducer::finish_agree(std::int64_t step) {
  MPIPE_CHECK(agreeing(), "no agreement in flight");
  Progress::Ticket ticket = agree_ticket_;
  agree_ticket_ = Progress::none;
  progress_->wait(ticket, timeout_, "the loss and gradient-norm allreduce, step", static_cast<int>(step));
  const int L = model_.size(), N = grid_.world().size();
  Agreed a;
  for (int i = 0; i < L; ++i) a.norm_squared += agree_buffer_[i];  // global layer order
  a.loss_sum = agree_buffer_[L];
  const double slowest = *std::max_element(agree_buffer_.begin() + L + 4, agree_buffer_.end());
  if (slowest > 0) a.bubble = std::max(0.0, 1.0 - agree_buffer_[L + 1] / (N * slowest));
  a.stop = agree_buffer_[L + 2] > 0.0;
  a.time_limit = agree_buffer_[L + 3] > 0.0;
  return a;
}

template <class T>
void Reducer::sum_over_replicas(std::span<T> values, std::int64_t update) {
  Progress::Ticket ticket = progress_->track(grid_.data().iallreduce(values, Reduce::sum), false);
  progress_->wait(ticket, timeout_, "the running statistics' sum over replicas, update", static_cast<int>(update));
}

// Buffers (BatchNorm's running statistics) saw only this replica's micro-batches: every
// replica takes their mean, so all end the step identical (and K-invariant: the sum runs
// over replicas in rank order).
// One sum over the replicas for all of a stage's layers (packed, element by element the
// same as one per layer), waited on like every other wait of a step: within --p2p-timeout.
void Reducer::settle_buffers(bool updated, std::int64_t update) {
  const bool replicas = grid_.replicas() > 1;
  if (deferred_batchnorm_) {
    if (!updated) {  // a skipped step (non-finite): its statistics are dropped with it
      clear_step_sums();
      return;
    }
    if (replicas) {  // each layer's sums are the same size on every replica of this stage
      auto packed = settle_sums_.begin();
      for (Layer* layer : deferred_) packed = std::copy(layer->step_sums().begin(), layer->step_sums().end(), packed);
      sum_over_replicas(std::span<double>(settle_sums_), update);
      packed = settle_sums_.begin();
      for (Layer* layer : deferred_) {
        const std::span<double> sums = layer->step_sums();
        std::copy_n(packed, sums.size(), sums.begin());
        packed += static_cast<std::ptrdiff_t>(sums.size());
      }
    }
    for (Layer* layer : deferred_) layer->apply_step_sums();
    return;
  }
  // Micro-batch statistics moved during the forwards, skipped step or not: averaged either way.
  if (!replicas || settle_values_.empty()) return;
  // Each buffer's values (fp32, where the layers move them: the device's master on a GPU)
  // beside its place in the packed host vector.
  auto each_buffer = [&](auto&& f) {
    std::size_t at = 0;
    for (const ParamEntry& e : params_.entries()) {
      if (!e.buffer) continue;
      const Tensor values = params_.param(e);
      f(values, make_tensor(settle_values_.data() + at, Shape{e.numel()}));
      at += static_cast<std::size_t>(e.numel());
    }
  };
  each_buffer([](const Tensor& values, const Tensor& packed) { ops::transfer(packed, values); });
  sum_over_replicas(std::span<float>(settle_values_), update);
  const auto n = static_cast<float>(grid_.replicas());
  for (float& v : settle_values_) v /= n;
  each_buffer([](const Tensor& values, const Tensor& packed) { ops::transfer(values, packed); });
}

}  // namespace mpipe
