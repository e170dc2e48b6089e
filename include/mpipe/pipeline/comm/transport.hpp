// The transport: moves one replica's activations forward and gradients backward between
// neighbouring stages, and keeps every posted message moving (Progress).
//
// Every receive of a step is posted before any compute, into a buffer of its own per
// micro-batch (and model stage: a rank with virtual stages holds several, each a channel);
// a send is posted as soon as its data is final, so the transfer of micro-batch i
// overlaps the compute of i + 1 on both sides. Tags come from (micro-batch, direction),
// and the receiving model stage where a rank holds more than one. Each channel's peers are
// the ranks of its neighbouring model stages, wherever the schedule placed them: with round
// robin the last pipeline stage sends activations on to the first; with the V of zbv a
// rank sends from one of its model stages to the other (MPI's message to itself, one
// copy). A skip (nn/skip_layers.hpp) that crosses model stages is a message of its own,
// from its producer's rank straight to its consumer's and its gradient back, past the
// stages between (torchgpipe's portals): its tags follow every stage's (SkipLink). On a
// GPU the messages go straight from and into device memory
// when MPI is CUDA-aware; otherwise through pinned host buffers, with the copies on
// their own streams, and a send is posted once its copy is done while the next
// micro-batch computes.
#pragma once
#include <chrono>
#include <span>
#include <string>
#include <vector>

#include "mpipe/backend/message.hpp"
#include "mpipe/core/tensor.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/pipeline/plan/partition.hpp"
#include "mpipe/pipeline/plan/grid.hpp"
#include "mpipe/pipeline/comm/progress.hpp"

namespace mpipe {

class Transport {
 public:
  using Clock = std::chrono::steady_clock;
  // A send as Progress saw it: posted, then complete (the data left this rank).
  struct Transfer {
    Direction direction;
    int channel, micro_batch;
    Clock::time_point posted, completed;
  };
  // One model stage of this rank. `input`: what it receives forward (its first layer's
  // input), `output`: what it receives backward (the gradient of its last layer's
  // output). The model's first stage receives no activations, its last no gradients.
  struct Channel {
    int stage;  // model stage
    Shape input, output;
    bool first, last;
    int previous, next;  // the pipeline stages of model stages stage - 1 and stage + 1; -1: none
  };

  // A skip between two model stages, one of them this rank's (or both: a virtual
  // stage's to another of its rank's, MPI's message to itself).
  struct SkipLink {
    int skip;                 // Model::skips() index
    Shape shape;              // one micro-batch's
    int producer, consumer;   // the pipeline stages (ranks of the replica) of its two model stages
    bool produces, consumes;  // on this rank
    // What a wait for it says: "the skip 'level1' of micro-batch" (activation) and
    // "the gradient of the skip 'level1' of micro-batch" (made once, not in the step).
    std::string forward_what, backward_what;
  };
  // The skips of `model` that cross model stages of `partition` with one end on
  // `stages_here` (model stages), for micro-batches of `micro` samples.
  static std::vector<SkipLink> skip_links(const Model& model, const Partition& partition, std::span<const int> stages_here,
                                          int micro);
  // Requests in flight at once for `links`: each micro-batch's message each way.
  static int skip_requests(std::span<const SkipLink> links, int micro_batches) {
    return 2 * micro_batches * static_cast<int>(links.size());
  }
  // The first tag index of skips (after every model stage's): `model_stages` x M.
  static int skip_tag_base(int model_stages, int micro_batches) { return model_stages * micro_batches; }

  // `channels` in ascending model stage; `model_stages`: K·v.
  Transport(const Grid& grid, Progress& progress, MessagePath path, DType dtype, int micro_batches,
            std::vector<Channel> channels, int model_stages, double timeout_s, std::vector<SkipLink> skips = {});

  // The step's receives, all of them, before any compute; `backward` false: only the
  // activations (a forward-only pass: evaluation).
  void post_receives(bool backward = true);
  // Waits for micro-batch `mb`'s activation (forward) or gradient (backward) on channel
  // `c`; returns the seconds waited. received() then holds it (on a GPU: for the compute
  // stream).
  double receive(Direction direction, int c, int mb);
  const Tensor& received(Direction direction, int c, int mb) const;
  // Sends `data` from channel `c`, which stays untouched until finish_sends():
  // activations forward to the next model stage, gradients backward to the previous one.
  void send(Direction direction, int c, int mb, const Tensor& data);
  // Between actions: posts the queued sends whose data has become ready (a GPU's).
  void between_actions() {
    if (!pending_sends_.empty()) post_ready_sends(false);
  }
  // Waits for micro-batch `mb`'s send in `direction` from channel `c`, whose data may then
  // be reused; returns the seconds waited (0 when it was not sent, or already waited for).
  double wait_sent(Direction direction, int c, int mb);
  // Waits for every send of the step; returns the seconds waited.
  double finish_sends();
  // This step's sends, once finish_sends() has returned.
  std::span<const Transfer> sent() const { return sent_; }

  // Skips, by Model::skips() index `skip` (a SkipLink's): where micro-batch mb's message
  // in `direction` is written before send_skip() (the producer's copy of its output, the
  // consumer's gradient of it): one buffer each for the step, untouched until
  // finish_sends().
  const Tensor& skip_buffer(Direction direction, int skip, int mb) const;
  void send_skip(Direction direction, int skip, int mb);
  // Waits for it at the other end; returns the seconds waited. received_skip() then holds it.
  double receive_skip(Direction direction, int skip, int mb);
  const Tensor& received_skip(Direction direction, int skip, int mb) const;
  // Bytes this rank has posted since it was made: between neighbouring stages, and of skips.
  std::uint64_t bytes_sent() const { return bytes_sent_; }
  std::uint64_t skip_bytes_sent() const { return skip_bytes_sent_; }
  // Test hook (MPIPE_TEST_FAIL=RANK:STEP:lose-skip): the next skip sent forward is dropped.
  void lose_next_skip() { lose_skip_ = true; }

 private:
  struct PendingSend {
    const Outbox* outbox;
    std::span<const std::byte> wire;
    Direction direction;
    int channel, micro_batch;
    int link = -1;  // a skip's (index into links_), or -1
  };
  void post_ready_sends(bool wait);
  // Without waking the progress thread: post_ready_sends wakes it once for all it posts.
  void post_send(std::span<const std::byte> wire, Direction direction, int c, int mb);
  void post_skip_send(std::span<const std::byte> wire, Direction direction, int link, int mb);
  int link_of(int skip) const;
  // Waits for a posted receive; a timeout names the rank `from` (a pipeline stage) that did not send.
  double wait_received(Progress::Ticket& ticket, const char* what, int mb, std::size_t bytes, int from);
  int skip_tag(int skip, int mb, Direction direction) const { return message_tag(skip_base_ + skip * micro_batches_ + mb, direction); }
  std::size_t link_slot(int link, int mb) const { return static_cast<std::size_t>(link * micro_batches_ + mb); }
  // The pipeline stage channel c's messages in `direction` go to, and the one they come from.
  int peer(Direction direction, int c) const;
  int source(Direction direction, int c) const;
  // The tag of micro-batch mb's message in `direction` into model stage `to`.
  int tag(int to, int mb, Direction direction) const {
    return message_tag(virtual_ ? to * micro_batches_ + mb : mb, direction);
  }
  std::size_t slot(int c, int mb) const { return static_cast<std::size_t>(c * micro_batches_ + mb); }
  static int index(Direction direction) { return static_cast<int>(direction); }

  const Grid& grid_;
  std::vector<Channel> channels_;
  int micro_batches_;
  bool virtual_;  // more than one model stage per pipeline stage
  Progress& progress_;
  MessagePath path_;
  DType dtype_;
  double timeout_;
  std::vector<Inbox> received_[2];                   // [direction][channel · M + micro-batch]
  std::vector<Progress::Ticket> receive_tickets_[2];
  std::vector<Progress::Ticket> send_tickets_;      // this step's, in order of posting
  std::vector<Transfer> sent_;
  std::vector<Outbox> outboxes_[2];                 // [direction][channel · M + micro-batch]
  std::vector<PendingSend> pending_sends_;          // queued, not yet posted; in order
  // Skips: [direction][link · M + micro-batch] what arrives (at the consumer forward, the
  // producer backward; empty at the other end) and what leaves (buffers as Inboxes: memory
  // of the device, staged where the path is), and the sends' tickets.
  std::vector<SkipLink> links_;
  int skip_base_ = 0;
  std::vector<Inbox> skip_received_[2], skip_kept_[2];
  std::vector<Progress::Ticket> skip_receive_tickets_[2];
  std::vector<Outbox> skip_outboxes_[2];
  std::vector<Progress::Ticket> skip_send_tickets_;
  std::uint64_t bytes_sent_ = 0, skip_bytes_sent_ = 0;
  bool lose_skip_ = false;  // lose_next_skip()
};
}  // namespace mpipe
