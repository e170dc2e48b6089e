// "No heap allocation in the step loop", checked: this binary counts every operator new,
// and a training step after the first must make none.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>

#include "tiny_gpt.hpp"
#include "local_trainer.hpp"

namespace {
std::atomic<long> g_allocations{0};
}

void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(size ? size : 1);  // the library's nothrow form would pair another allocator with our delete
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }

using namespace mpipe;
using mpipe::test::Trainer;

TEST_CASE("a training step after the first allocates nothing on the heap") {
  for (const std::string kind : {"gpt", "mlp", "gpt zb-h1", "gpt overlap", "resnet", "resnet deferred", "unet"}) {
    TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 32, .heads = 4, .seq_len = 16, .vocab = 64, .dropout = 0.1f,
                                    .batch_size = 8, .micro_batches = 2, .steps = 10, .seed = 1, .lr = OptimizerConfig{}.lr});
    if (kind == "gpt zb-h1") c.pipeline.schedule = "zb-h1";  // W's stash in the slots
    if (kind == "gpt overlap") c.pipeline.overlap_steps = true;  // updates ahead, bets won and lost
    c.model.kind = kind.substr(0, 3);  // the MLP preset at its own sizes
    if (kind.starts_with("resnet")) {  // convolutions, BatchNorm under both rules, pooling, residual sums
      c.model.kind = "resnet";
      c.model.layers = 18;
      c.model.image = 16;
      c.model.width = 8;
      c.model.classes = 4;
      if (kind == "resnet deferred") c.pipeline.batchnorm = "deferred";
    }
    if (kind == "unet")  // skips (stash, concat, add), upsampling, a label per pixel
      c.model.kind = MPIPE_TEST_SOURCE_DIR "/reference/unet.toml";
    INFO(kind);  // doctest's INFO allocates: before the count starts
    Trainer trainer(c);
    trainer.step(0);  // sizes the arena
    const long before = g_allocations.load();
    const std::size_t growths = trainer.arena().growths();
    for (int step = 1; step < 4; ++step) {
      if (!c.pipeline.overlap_steps) {
        trainer.step(step);
        continue;
      }
      for (const StepResult& r : trainer.advance(step)) (void)r;
      if (step == 3) (void)trainer.settle();
    }
    CHECK(g_allocations.load() == before);
    CHECK(trainer.arena().growths() == growths);
    if (c.pipeline.overlap_steps) CHECK(trainer.rolled_back() >= 1);  // --clip-grad 1.0: the path that goes back ran
  }
}
