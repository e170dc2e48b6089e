// Host-side parts of the GPU backend that need no GPU: bf16 rounding, the device arena's
// two pools, and the op dispatcher's device and element-type checks.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <limits>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/backend/ops.hpp"
#include "mpipe/core/arena.hpp"
#include "mpipe/core/bf16.hpp"

using namespace mpipe;

TEST_CASE("bf16: round to nearest even, exact round trip, NaN and infinity kept") {
  for (float v : {0.0f, 1.0f, -2.5f, 1.0f / 128, 3.0e38f, -1.0e-30f}) CHECK(to_float(to_bf16(v)) == doctest::Approx(v).epsilon(1.0 / 256));
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa, 1.
  CHECK(to_float(to_bf16(1.0f + 0x1p-8f)) == 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
  CHECK(to_float(to_bf16(1.0f + 3 * 0x1p-8f)) == 1.0f + 0x1p-6f);
  CHECK(to_float(to_bf16(1.0f + 0x1p-8f + 0x1p-20f)) == 1.0f + 0x1p-7f);  // above halfway: up
  for (std::uint32_t bits = 0; bits < 0x10000u; bits += 7) {
    const bf16 b{static_cast<std::uint16_t>(bits)};
    const float f = to_float(b);
    if (!std::isnan(f)) CHECK(to_bf16(f).bits == b.bits);  // every bf16 is exactly a float
  }
  CHECK(std::isnan(to_float(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(to_float(to_bf16(std::numeric_limits<float>::infinity()))));
  CHECK(std::isinf(to_float(to_bf16(3.4e38f))));  // rounds past the largest bf16
}

namespace {
int device_blocks = 0;
void* fake_allocate(std::size_t bytes) {
  ++device_blocks;
  return std::aligned_alloc(256, (bytes + 255) / 256 * 256);
}
void fake_release(void* p) noexcept {
  --device_blocks;
  std::free(p);
}
void fake_zero(void* p, std::size_t bytes) { std::memset(p, 0, bytes); }
}  // namespace

TEST_CASE("device arena: tensors from the device allocator, contexts from host memory") {
  // The allocator is host memory standing in for the device: what is checked is which
  // pool each request goes to, and that blocks are handed back.
  DeviceMemory memory{Device::cuda, &fake_allocate, &fake_release, &fake_zero};
  {
    Arena arena(memory);
    const Tensor t = arena.tensor(Shape{1000}, DType::bf16);
    CHECK(t.device == Device::cuda);
    CHECK(t.bytes() == 2000);
    CHECK(device_blocks == 1);
    struct Ctx {
      int a = 7;
    };
    Ctx* c = arena.objects<Ctx>(3);
    CHECK(c[2].a == 7);
    CHECK(arena.high_water() == 2048);  // the tensor only: contexts are not device memory
    const Tensor z = arena.zeros(Shape{300000});  // outgrows the first block
    CHECK(z.device == Device::cuda);
    CHECK(device_blocks == 2);
    arena.reset();  // folds into one block of the high-water size
    CHECK(device_blocks == 1);
    CHECK(arena.capacity() >= arena.high_water());
  }
  CHECK(device_blocks == 0);
}

TEST_CASE("ops: tensors on different devices or of different element types are refused") {
  float a[4] = {1, 2, 3, 4}, b[4] = {};
  const Tensor x = make_tensor(a, Shape{4});
  Tensor y = make_tensor(b, Shape{4});
  ops::add(y, x);
  CHECK(b[3] == 4.0f);
  Tensor on_gpu = y;
  on_gpu.device = Device::cuda;
  CHECK_THROWS_WITH_AS(ops::add(on_gpu, x), doctest::Contains("tensors on cuda and cpu"), Error);
  Tensor half = y;
  half.dtype = DType::bf16;
  CHECK_THROWS_WITH_AS(ops::copy(half, x), doctest::Contains("tensors of bf16 and fp32"), Error);
  CHECK_THROWS_WITH_AS(ops::convert(half, x), doctest::Contains("the CPU computes in fp32 only"), Error);
}

TEST_CASE("cuda runtime: without a GPU, device_count() is 0 and says why") {
  // Holds on any machine where no GPU is visible: CI, or CUDA_VISIBLE_DEVICES empty.
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  std::string why;
  const int count = cuda::device_count(&why);
  if (count == 0) {
    CHECK_FALSE(why.empty());
  } else {
    CHECK(cuda::built());
    MESSAGE("a GPU is visible (CUDA_VISIBLE_DEVICES=", visible ? visible : "unset", "): ", count);
  }
  if (!cuda::built()) CHECK(count == 0);
}

TEST_CASE("cuda runtime: cuBLAS, cuBLASLt and cuDNN load at first use, not at start") {
  if (!cuda::built()) {
    CHECK_THROWS_WITH_AS(cuda::load_libraries(), doctest::Contains("built without the CUDA backend"), Error);
    return;
  }
  // Not mapped by the dynamic loader: a CPU run never pays for them.
  const auto mapped = [](const char* name) {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line))
      if (line.find(name) != std::string::npos) return true;
    return false;
  };
  if (!cuda::active()) CHECK_FALSE(mapped("libcublasLt.so"));
  // Every function the backend calls is found (no GPU needed), and a second call is free.
  CHECK_NOTHROW(cuda::load_libraries());
  CHECK(mapped("libcublasLt.so"));
  CHECK(mapped("libcudnn.so"));
  CHECK_NOTHROW(cuda::load_libraries());
}
