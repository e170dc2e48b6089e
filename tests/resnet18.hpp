// The mpi tests' small ResNet-18 run.
#pragma once
#include "mpipe/app/config.hpp"

namespace mpipe::test {

// A ResNet-18 of `width` on `image` x `image` inputs, `batch` samples in 4 micro-batches,
// `steps` steps, one thread per rank.
inline TrainConfig resnet18(int width, int image, int batch, int steps) {
  TrainConfig c;
  c.model.kind = "resnet";
  c.model.layers = 18;
  c.model.width = width;
  c.model.image = image;
  c.batch_size = batch;
  c.micro_batches = 4;
  c.steps = steps;
  c.threads = 1;
  return c;
}

}  // namespace mpipe::test
