// Channels last on the CPU (train --channels-last on): the layout swap moves each element
// where NHWC puts it, and every image op on NHWC tensors (which the CPU runs through
// channels first) gives the channels-first op's bits, element by element.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "image_ops.hpp"
#include "mpipe/backend/conv_ops.hpp"
#include "mpipe/backend/cpu/ops.hpp"

using namespace mpipe;

TEST_CASE("change_layout puts element (n, c, h, w) of NCHW at ((n H + h) W + w) C + c and back, adding per mode") {
  const std::int64_t N = 2, C = 3, H = 4, W = 5;
  std::vector<float> first(static_cast<std::size_t>(N * C * H * W)), last(first.size()), back(first.size(), 1.0f);
  for (std::size_t i = 0; i < first.size(); ++i) first[i] = static_cast<float>(i);
  const Shape s{N, C, H, W};
  const Tensor tf{first.data(), s, DType::f32, Device::cpu}, tl{last.data(), s, DType::f32, Device::cpu},
      tb{back.data(), s, DType::f32, Device::cpu};
  ops::change_layout(tl, tf, true);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t w = 0; w < W; ++w)
          CHECK(last[static_cast<std::size_t>(((n * H + h) * W + w) * C + c)] ==
                first[static_cast<std::size_t>(((n * C + c) * H + h) * W + w)]);
  ops::change_layout(tb, tl, false, GradMode::accumulate);
  for (std::size_t i = 0; i < first.size(); ++i) CHECK(back[i] == first[i] + 1.0f);
  ops::change_layout(tb, tl, false);
  CHECK(back == first);
  // Tiles of 32 with partial edges: 40 channels by 37 positions, on two threads.
  cpu::set_threads(2);
  const std::int64_t C2 = 40, P2 = 37;
  std::vector<float> a(static_cast<std::size_t>(C2 * P2)), b(a.size()), c(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
  cpu::swap_inner(b.data(), a.data(), 1, C2, P2, false);
  cpu::swap_inner(c.data(), b.data(), 1, P2, C2, false);
  cpu::set_threads(1);
  CHECK(b == test::to_last(a, 1, C2, P2));
  CHECK(c == a);
}

TEST_CASE("every image op on channels-last tensors gives the channels-first op's bits on the CPU") {
  for (const int threads : {1, 2}) {
    CAPTURE(threads);
    cpu::set_threads(threads);
    test::HostMemory first_memory, last_memory;
    const auto first = test::run_image_ops(first_memory, false);
    const auto last = test::run_image_ops(last_memory, true);
    cpu::set_threads(1);
    REQUIRE(first.size() == last.size());
    REQUIRE(first.size() == 26);
    for (const auto& [name, values] : first) {
      CAPTURE(name);
      REQUIRE(last.count(name) == 1);
      const std::vector<float>& other = last.at(name);
      REQUIRE(other.size() == values.size());
      CHECK(std::memcmp(other.data(), values.data(), values.size() * sizeof(float)) == 0);
      // Not all zeros (a result that was never written would pass the comparison).
      bool any = false;
      for (const float v : values) any = any || v != 0.0f;
      CHECK(any);
    }
    // The swap and back, added onto the image: twice each element, exactly.
    const std::vector<float>&swapped = last.at("swapped"), &twice = last.at("swapped back, added");
    for (std::size_t i = 0; i < swapped.size(); ++i) CHECK(twice[i] == 2.0f * swapped[i]);
  }
}
