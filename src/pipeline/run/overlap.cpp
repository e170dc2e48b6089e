// --overlap-steps: a rank's update made ahead of the world's agreement, the bet checked
// a pass later, and the rollback to the agreed update when it is lost.
#include "mpipe/pipeline/run/overlap.hpp"

#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

UpdateBackup::UpdateBackup(ParamStore& params, Optimizer& optimizer, StepDevice& device)
    : params_(params), optimizer_(optimizer), device_(device) {
  std::size_t buffers = 0;
  for (const ParamEntry& e : params.entries())
    if (e.buffer && !e.alias) {
      buffer_spans_.emplace_back(e.param_offset, static_cast<std::size_t>(e.numel()));
      buffers += static_cast<std::size_t>(e.numel());
    }
  const std::size_t sizes[parts] = {params.master().size(), params.grads().size(), optimizer.live_state(0).size(),
                                    optimizer.live_state(1).size(), buffers};
  for (int part = 0; part < parts; ++part) at_[part + 1] = at_[part] + sizes[part];
  if (device.kind() == Device::cuda) {
    on_device_ = cuda::DeviceBuffer(std::max<std::size_t>(1, at_[parts]) * sizeof(float));
    saved_ = on_device_.as<float>();
  } else {
    host_.resize(at_[parts]);
    saved_ = host_.data();
  }
}

std::span<float> UpdateBackup::live(Part part) const {
  switch (part) {
    case values:
    case statistics: return params_.master();
    case gradients: return params_.grads();
    case first: return optimizer_.live_state(0);
    case second: return optimizer_.live_state(1);
    default: break;
  }
  MPIPE_CHECK(false, "no saved part ", static_cast<int>(part));
  return {};
}

void UpdateBackup::copy(Part part, bool back) {
  const std::span<float> state = live(part);
  float* saved = saved_ + at_[part];
  const auto copy = [&](float* at, std::size_t count) {
    if (count == 0) return;  // SGD has no second state
    device_.copy(back ? at : saved, back ? saved : at, count * sizeof(float));
    saved += count;
  };
  if (part != statistics) {
    copy(state.data(), state.size());
    return;
  }
  for (const auto& [offset, count] : buffer_spans_) copy(state.data() + offset, count);
}

// --overlap-steps (post-validation, Qi et al. 2023, section 4): a rank updates its
// parameters as soon as its own part of a step is done, on the bet that the world's
// agreement will find the loss and norm finite and the norm within --clip-grad, and goes
// on with the next step's pipeline while the agreement moves. The first stages start the
// next step while the last ones finish this one, so the warm-up of one step fills the
// cool-down of the one before (ZB-H2's parallelogram). The bet is checked once this
// rank's next pipeline pass is done: won, the update stands, and it is the very update
// the agreement would have made; lost (every rank sees the same sum, so every rank
// alike), the pass is dropped, the state goes back to before the update, the agreed
// update (clipped, or none) is made, and the pass runs again. After a lost bet the next
// step waits for its agreement; the one after a step within the limits bets again.
std::span<const StepResult> Executor::advance(std::int64_t step) {
  if (!plan_.options.overlap_steps) {
    results_[0] = this->step(step);
    return {results_.data(), 1};
  }
  return named_errors(*grid_, step, [&] { return advance_unchecked(step); });
}

std::span<const StepResult> Executor::advance_unchecked(std::int64_t step) {
  const auto start = Clock::now();
  timeline_.times() = PhaseTimes{};
  std::size_t n = 0;
  reducer_->clear_step_sums();
  run_pipeline(step);
  double dropped = 0;  // compute of a pass that was dropped: not busy, but bubble
  if (pending_) {
    results_[n++] = validate_pending(/*pass_done=*/true);
    if (results_[n - 1].rolled_back) {  // again, with the parameters the world agreed on
      dropped = timeline_.times().compute();
      reducer_->clear_step_sums();
      run_pipeline(step);
    }
  }
  // The bubble as without --overlap-steps: each rank's pipeline pass, which starts as soon
  // as the rank is done with the step before and includes its wait for the first input.
  reduce_and_agree(step, pipeline_seconds_, dropped);
  if (speculate_) {
    const auto opt_start = Clock::now();
    if (state_reader_) state_reader_->finish();
    backup_->save_state();
    optimizer_->update(learning_rate(plan_.options.optimizer, step, plan_.options.steps), ++updates_);
    reducer_->start_gather(updates_);
    reducer_->settle_buffers(true, updates_);
    reducer_->finish_gather();
    backup_->save_statistics();
    timeline_.times().optimizer += since(opt_start);
    timeline_.record(step, TraceEvent::optimizer, -1, opt_start);
    pending_ = true;
    pending_step_ = step;
    ++speculated_;
  }
  if (!pending_) {
    finish_agree(step);
    StepResult r = agreed_result(step);
    update(r);
    speculate_ = plain_update(r);
    r.seconds = since(start);
    results_[n++] = r;
  }
  persistent_->reset();
  // A step's time is this rank's cycle, from its pass's start to its update's end: steps
  // back to back follow each other at that pace.
  pending_seconds_ = since(start);
  timeline_.close(pending_seconds_);
  return {results_.data(), n};
}

std::optional<StepResult> Executor::settle() {
  if (!pending_) return std::nullopt;
  return named_errors(*grid_, pending_step_, [&] { return validate_pending(/*pass_done=*/false); });
}

StepResult Executor::validate_pending(bool pass_done) {
  pending_ = false;
  finish_agree(pending_step_);
  StepResult r = agreed_result(pending_step_);
  r.seconds = pending_seconds_;
  if (plain_update(r)) {
    speculate_ = true;
    return r;  // the update made ahead is the one the agreement makes
  }
  // The bet is lost: the next pass (if it ran) saw parameters the world does not agree
  // on. Its sums finish as on every other rank, then it is dropped.
  if (pass_done) reducer_->reduce();
  backup_->restore_state();
  params_->refresh_compute_copy();  // a GPU's bf16 copy of the values
  --updates_;
  r.rolled_back = true;
  ++rolled_back_;
  speculate_ = false;
  update(r);  // the agreed one, as without --overlap-steps
  // Running statistics as the update made ahead left them (the dropped pass moved them,
  // and with --batchnorm deferred its sums replaced the step's); a skip settles them itself.
  if (!r.skipped) backup_->restore_statistics();
  return r;
}

}  // namespace mpipe
