// Point-to-point messages between neighbouring stages, through the device's message
// buffers (backend/message.hpp).
#include "mpipe/pipeline/comm/transport.hpp"

#include <algorithm>

#include "mpipe/pipeline/comm/hosts.hpp"

namespace mpipe {

Transport::Transport(const Grid& grid, Progress& progress, MessagePath path, DType dtype, int micro_batches,
                     std::vector<Channel> channels, int model_stages, double timeout_s, std::vector<SkipLink> skips)
    : grid_(grid), channels_(std::move(channels)), micro_batches_(micro_batches),
      virtual_(model_stages > grid.stages()), progress_(progress), path_(path), dtype_(dtype), timeout_(timeout_s),
      links_(std::move(skips)), skip_base_(skip_tag_base(model_stages, micro_batches)) {
  const int M = micro_batches, C = static_cast<int>(channels_.size());
  // Every (channel, micro-batch) has an inbox per direction; the model's first stage
  // receives no activations and its last no gradients: theirs stay empty.
  for (const Channel& c : channels_)
    for (int mb = 0; mb < M; ++mb) {
      received_[index(Direction::forward)].push_back(c.first ? Inbox{} : Inbox(c.input, dtype_, path_));
      received_[index(Direction::backward)].push_back(c.last ? Inbox{} : Inbox(c.output, dtype_, path_));
    }
  for (auto& tickets : receive_tickets_) tickets.assign(static_cast<std::size_t>(C * M), Progress::none);
  send_tickets_.reserve(2 * static_cast<std::size_t>(C * M));
  sent_.reserve(2 * static_cast<std::size_t>(C * M));
  pending_sends_.reserve(2 * static_cast<std::size_t>(C * M));
  // Activations leave by the end of the stage, gradients by its start.
  for (const Direction d : {Direction::forward, Direction::backward})
    for (const Channel& c : channels_) {
      const Shape& shape = d == Direction::forward ? c.output : c.input;
      const bool sends = d == Direction::forward ? !c.last : !c.first;
      for (int mb = 0; mb < M; ++mb)
        outboxes_[index(d)].emplace_back(sends ? static_cast<std::size_t>(shape.numel()) * dtype_size(dtype_) : 0, path_);
    }
  // A skip arrives forward at its consumer and backward at its producer, and leaves from
  // the other end.
  for (const Direction d : {Direction::forward, Direction::backward})
    for (const SkipLink& link : links_) {
      const bool arrives = d == Direction::forward ? link.consumes : link.produces;
      const bool leaves = d == Direction::forward ? link.produces : link.consumes;
      for (int mb = 0; mb < M; ++mb) {
        skip_received_[index(d)].push_back(arrives ? Inbox(link.shape, dtype_, path_) : Inbox{});
        skip_kept_[index(d)].push_back(leaves ? Inbox(link.shape, dtype_, path_) : Inbox{});
        skip_outboxes_[index(d)].emplace_back(leaves ? static_cast<std::size_t>(link.shape.numel()) * dtype_size(dtype_) : 0, path_);
      }
    }
  for (auto& tickets : skip_receive_tickets_) tickets.assign(links_.size() * static_cast<std::size_t>(M), Progress::none);
  skip_send_tickets_.reserve(2 * links_.size() * static_cast<std::size_t>(M));
  pending_sends_.reserve(2 * (static_cast<std::size_t>(C) + links_.size()) * static_cast<std::size_t>(M));
}

std::vector<Transport::SkipLink> Transport::skip_links(const Model& model, const Partition& partition,
                                                       std::span<const int> stages_here, int micro) {
  const auto here = [&](int s) { return std::find(stages_here.begin(), stages_here.end(), s) != stages_here.end(); };
  const std::vector<Shape> shapes = model.shapes(micro);
  std::vector<SkipLink> links;
  for (int k = 0; k < static_cast<int>(model.skips().size()); ++k) {
    const Model::Skip& skip = model.skips()[static_cast<std::size_t>(k)];
    const int from = partition.stage_of(skip.producer), to = partition.stage_of(skip.consumer);
    if (from == to || !(here(from) || here(to))) continue;
    links.push_back({k, shapes[static_cast<std::size_t>(skip.producer) + 1], partition.pipeline_stage(from),
                     partition.pipeline_stage(to), here(from), here(to), cat("the skip '", skip.name, "' of micro-batch"),
                     cat("the gradient of the skip '", skip.name, "' of micro-batch")});
  }
  return links;
}

int Transport::link_of(int skip) const {
  for (std::size_t l = 0; l < links_.size(); ++l)
    if (links_[l].skip == skip) return static_cast<int>(l);
  throw Error(cat("skip ", skip, " has no link on this rank"));
}

const Tensor& Transport::skip_buffer(Direction direction, int skip, int mb) const {
  return skip_kept_[index(direction)][link_slot(link_of(skip), mb)].tensor();
}

void Transport::send_skip(Direction direction, int skip, int mb) {
  if (lose_skip_ && direction == Direction::forward) {
    lose_skip_ = false;
    return;
  }
  const int link = link_of(skip);
  Outbox& outbox = skip_outboxes_[index(direction)][link_slot(link, mb)];
  const std::span<const std::byte> wire = outbox.leave(skip_kept_[index(direction)][link_slot(link, mb)].tensor());
  pending_sends_.push_back({&outbox, wire, direction, -1, mb, link});
  post_ready_sends(false);
}

void Transport::post_skip_send(std::span<const std::byte> wire, Direction direction, int link, int mb) {
  const SkipLink& l = links_[static_cast<std::size_t>(link)];
  const int to = direction == Direction::forward ? l.consumer : l.producer;
  skip_send_tickets_.push_back(progress_.track(grid_.pipeline().isend(wire, to, skip_tag(l.skip, mb, direction)), true, false));
  skip_bytes_sent_ += wire.size();
}

double Transport::receive_skip(Direction direction, int skip, int mb) {
  post_ready_sends(true);
  const int link = link_of(skip);
  const SkipLink& l = links_[static_cast<std::size_t>(link)];
  Inbox& m = skip_received_[index(direction)][link_slot(link, mb)];
  const double waited = wait_received(skip_receive_tickets_[index(direction)][link_slot(link, mb)],
                                      (direction == Direction::forward ? l.forward_what : l.backward_what).c_str(),
                                      mb, m.wire().size(), direction == Direction::forward ? l.producer : l.consumer);
  m.arrived();
  return waited;
}

const Tensor& Transport::received_skip(Direction direction, int skip, int mb) const {
  return skip_received_[index(direction)][link_slot(link_of(skip), mb)].tensor();
}

int Transport::peer(Direction direction, int c) const {
  const Channel& channel = channels_[static_cast<std::size_t>(c)];
  return direction == Direction::forward ? channel.next : channel.previous;
}

int Transport::source(Direction direction, int c) const {
  // Activations come from the previous model stage, gradients from the next.
  return peer(direction == Direction::forward ? Direction::backward : Direction::forward, c);
}

void Transport::post_receives(bool backward) {
  // All of a step's receives at once, none waking the progress thread: on a rank bound
  // to one core each wake is two context switches and a sweep of every request, between
  // this rank's posts (K = 2 U-Net: 0.8-1.4 ms a step on the first stage's critical path,
  // 24 posts; 10 us without). The compute loop's test before the first action sees them.
  const Communicator& pipe = grid_.pipeline();
  send_tickets_.clear();
  sent_.clear();
  pending_sends_.clear();
  for (const Direction d : {Direction::forward, Direction::backward}) {
    if (d == Direction::backward && !backward) continue;
    for (int c = 0; c < static_cast<int>(channels_.size()); ++c)
      for (int mb = 0; mb < micro_batches_; ++mb) {
        Inbox& m = received_[index(d)][slot(c, mb)];
        if (m.empty()) continue;  // the model's first (last) stage
        receive_tickets_[index(d)][slot(c, mb)] =
            progress_.track(pipe.irecv(m.wire(), source(d, c), tag(channels_[static_cast<std::size_t>(c)].stage, mb, d)), true,
                            false);
      }
    for (std::size_t l = 0; l < links_.size(); ++l)
      for (int mb = 0; mb < micro_batches_; ++mb) {
        Inbox& m = skip_received_[index(d)][link_slot(static_cast<int>(l), mb)];
        if (m.empty()) continue;
        const int from = d == Direction::forward ? links_[l].producer : links_[l].consumer;
        skip_receive_tickets_[index(d)][link_slot(static_cast<int>(l), mb)] =
            progress_.track(pipe.irecv(m.wire(), from, skip_tag(links_[l].skip, mb, d)), true, false);
      }
  }
}

double Transport::receive(Direction direction, int c, int mb) {
  // A neighbour may be waiting for one of our queued sends before it can send this.
  post_ready_sends(true);
  Inbox& m = received_[index(direction)][slot(c, mb)];
  const double waited = wait_received(receive_tickets_[index(direction)][slot(c, mb)],
                                      direction == Direction::forward ? "the activation of micro-batch" : "the gradient of micro-batch",
                                      mb, m.wire().size(), source(direction, c));
  m.arrived();
  return waited;
}

double Transport::wait_received(Progress::Ticket& ticket, const char* what, int mb, std::size_t bytes, int from) {
  try {
    return progress_.wait(ticket, timeout_, what, mb, static_cast<long>(bytes)).waited;
  } catch (const Error& e) {
    // Name the rank that did not send: the first of a chain of waiting ranks is stuck.
    const int rank = grid_.shape().rank_of(from, grid_.replica());
    rethrow_as(e, cat(e.what(), "; it comes from rank ", rank, " (stage ", from, ")", on_host(rank)));
  }
}

const Tensor& Transport::received(Direction direction, int c, int mb) const {
  return received_[index(direction)][slot(c, mb)].tensor();
}

// A send is queued with its outbox and posted by post_ready_sends() once its data is
// there: on the CPU at once; on a GPU once the compute stream (and a staged copy-out)
// has made it final, so the host goes on queueing work meanwhile.
void Transport::send(Direction direction, int c, int mb, const Tensor& data) {
  Outbox& outbox = outboxes_[index(direction)][slot(c, mb)];
  const std::span<const std::byte> wire = outbox.leave(data);
  pending_sends_.push_back({&outbox, wire, direction, c, mb});
  post_ready_sends(false);
}

void Transport::post_send(std::span<const std::byte> wire, Direction direction, int c, int mb) {
  const int to = channels_[static_cast<std::size_t>(c)].stage + (direction == Direction::forward ? 1 : -1);
  send_tickets_.push_back(progress_.track(grid_.pipeline().isend(wire, peer(direction, c), tag(to, mb, direction)), true, false));
  sent_.push_back({direction, c, mb, {}, {}});
  bytes_sent_ += wire.size();
}

// Posts queued sends in order while their data is ready; with `wait`, waits for all.
// Called between actions, and with `wait` before any blocking wait. The progress thread
// is woken once for them all (on a GPU several sends become ready at once).
void Transport::post_ready_sends(bool wait) {
  std::size_t posted = 0;
  for (; posted < pending_sends_.size(); ++posted) {
    PendingSend& p = pending_sends_[posted];
    if (wait) p.outbox->wait();
    else if (!p.outbox->ready()) break;
    if (p.link >= 0) post_skip_send(p.wire, p.direction, p.link, p.micro_batch);
    else post_send(p.wire, p.direction, p.channel, p.micro_batch);
  }
  if (posted == 0) return;
  pending_sends_.erase(pending_sends_.begin(), pending_sends_.begin() + static_cast<std::ptrdiff_t>(posted));
  progress_.wake();
}

double Transport::wait_sent(Direction direction, int c, int mb) {
  // Still queued behind its GPU data (not seen in practice: by a micro-batch's backward its
  // activation has reached the next stage): post the queue, waiting for the data. Sends
  // of later micro-batches stay queued, so the host does not wait for the GPU here.
  for (const PendingSend& p : pending_sends_)
    if (p.direction == direction && p.channel == c && p.micro_batch == mb) {
      post_ready_sends(true);
      break;
    }
  for (std::size_t i = 0; i < send_tickets_.size(); ++i) {
    if (sent_[i].direction != direction || sent_[i].channel != c || sent_[i].micro_batch != mb ||
        send_tickets_[i] == Progress::none)
      continue;
    const Progress::Completion done =
        progress_.wait(send_tickets_[i], timeout_, "a send to a neighbour stage, request", static_cast<int>(i));
    sent_[i].posted = done.posted;
    sent_[i].completed = done.completed;
    return done.waited;
  }
  return 0.0;
}

double Transport::finish_sends() {
  post_ready_sends(true);
  double waited = 0.0;
  for (std::size_t i = 0; i < send_tickets_.size(); ++i) {
    if (send_tickets_[i] == Progress::none) continue;  // waited for by wait_sent()
    const Progress::Completion c =
        progress_.wait(send_tickets_[i], timeout_, "a send to a neighbour stage, request", static_cast<int>(i));
    sent_[i].posted = c.posted;
    sent_[i].completed = c.completed;
    waited += c.waited;
  }
  send_tickets_.clear();
  for (std::size_t i = 0; i < skip_send_tickets_.size(); ++i)
    waited += progress_.wait(skip_send_tickets_[i], timeout_, "a skip's send, request", static_cast<int>(i)).waited;
  skip_send_tickets_.clear();
  return waited;
}

}  // namespace mpipe
