// The single-process trainer with micro-batch gradient accumulation.
#include "mpipe/pipeline/trainer.hpp"

#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

namespace mpipe {

void validate(const TrainConfig& c) {
  validate(c.model);
  validate(c.optimizer);
  MPIPE_REQUIRE(c.batch_size > 0, "e.g. --batch-size 32", "--batch-size must be positive, got ", c.batch_size);
  MPIPE_REQUIRE(c.micro_batches > 0, "e.g. --micro-batches 4", "--micro-batches must be positive, got ", c.micro_batches);
  MPIPE_REQUIRE(c.batch_size % c.micro_batches == 0, "pick --micro-batches dividing --batch-size",
                "--batch-size ", c.batch_size, " is not divisible by --micro-batches ", c.micro_batches);
  MPIPE_REQUIRE(c.steps > 0, "e.g. --steps 100", "--steps must be positive, got ", c.steps);
  MPIPE_REQUIRE(c.threads >= 0, "e.g. --threads 2, or 0 for every core", "--threads must be >= 0, got ", c.threads);
  MPIPE_REQUIRE(c.log_every > 0, "e.g. --log-every 10", "--log-every must be positive, got ", c.log_every);
}

Trainer::Trainer(const TrainConfig& config) : config_(config), model_(config.model) {
  validate(config);
  dataset_ = make_dataset(config.data, config.model, config.seed);  // bad files fail fast
  params_ = std::make_unique<ParamStore>(model_, 0, model_.size(), config.seed);
  optimizer_ = std::make_unique<Optimizer>(*params_, config.optimizer);
  const int64_t micro = config.batch_size / config.micro_batches;
  shapes_ = model_.shapes(micro);
  // The mini-batch's inputs and targets, allocated once.
  const Shape in = model_.input_shape(config.batch_size), tg = model_.target_shape(config.batch_size);
  batch_memory_ = std::make_unique<std::byte[]>(static_cast<std::size_t>(in.numel() + tg.numel()) * 4);
  inputs_ = {batch_memory_.get(), in, model_.input_dtype(), Device::cpu};
  targets_ = {batch_memory_.get() + in.numel() * 4, tg, DType::i32, Device::cpu};
}

double Trainer::compute_gradients(std::int64_t step) {
  const int64_t B = config_.batch_size, M = config_.micro_batches, micro = B / M;
  const int L = model_.size();
  params_->zero_grads();
  dataset_->fill(static_cast<std::uint64_t>(step) * B, B, inputs_, targets_);
  const int64_t in_per_sample = inputs_.numel() / B, tg_per_sample = targets_.numel() / B;
  const float loss_scale = 1.0f / static_cast<float>(B * model_.rows_per_sample());
  double loss_sum = 0.0;
  for (int64_t mb = 0; mb < M; ++mb) {
    Pass pass;
    pass.arena = &arena_;
    pass.seed = config_.seed;
    pass.step = static_cast<std::uint64_t>(step);
    pass.sample_begin = static_cast<std::uint64_t>(mb * micro);
    pass.training = true;
    pass.targets = {static_cast<std::byte*>(targets_.data) + mb * micro * tg_per_sample * 4,
                    model_.target_shape(micro), DType::i32, Device::cpu};
    pass.loss_scale = loss_scale;
    Tensor x = {static_cast<std::byte*>(inputs_.data) + mb * micro * in_per_sample * 4,
                shapes_[0], model_.input_dtype(), Device::cpu};
    Context* contexts = arena_.objects<Context>(static_cast<std::size_t>(L));
    for (int i = 0; i < L; ++i) x = model_.layer(i).forward(x, contexts[i], pass);
    loss_sum += contexts[L - 1].value;
    Tensor dy = x;  // the loss layer ignores its incoming gradient
    for (int i = L - 1; i >= 0; --i) {
      Tensor dx = i > 0 ? arena_.tensor(shapes_[i]) : Tensor{};
      model_.layer(i).backward(contexts[i], dy, dx, GradMode::overwrite, pass);
      dy = dx;
    }
    arena_.reset();
  }
  return loss_sum / static_cast<double>(B * model_.rows_per_sample());
}

StepResult Trainer::step(std::int64_t step) {
  const auto start = std::chrono::steady_clock::now();
  StepResult result;
  result.step = step;
  result.loss = compute_gradients(step);
  const int L = model_.size();
  double per_layer[1024];
  MPIPE_CHECK(L <= 1024, "more than 1024 layers");
  params_->grad_sum_squares({per_layer, static_cast<std::size_t>(L)});
  double total = 0.0;
  for (int i = 0; i < L; ++i) total += per_layer[i];  // global layer order
  result.grad_norm = std::sqrt(total);
  result.lr = learning_rate(config_.optimizer, step, config_.steps);
  if (!std::isfinite(result.grad_norm) || !std::isfinite(result.loss)) {
    result.skipped = true;
  } else {
    const float clip = config_.optimizer.clip_grad;
    if (clip > 0.0f && result.grad_norm > clip) {
      const auto factor = static_cast<float>(clip / result.grad_norm);
      cpu::scale(params_->grads().data(), factor, static_cast<int64_t>(params_->grads().size()));
    }
    optimizer_->update(result.lr, ++updates_);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace mpipe
