// Generation on the GPU against the CPU (promise 5): a tiny GPT's decoder, the same
// weights on both devices, logits token by token (a prompt, then one token at a time,
// past half the context) in fp32 and bf16, a linear head and one in vocabulary chunks;
// and the greedy tokens of both agree where the CPU's two best logits are apart.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "mpipe/nn/decoder.hpp"
#include "mpipe/nn/params.hpp"
#include "tiny_gpt.hpp"

using namespace mpipe;

namespace {

// Logits of each position's forward (a prompt of 5, then a token at a time) on `device`.
std::vector<std::vector<float>> decode_all(int head_chunks, Device device, DType dtype, const std::vector<std::int32_t>& ids) {
  TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 64, .heads = 2, .seq_len = 32, .vocab = 96, .dropout = 0.0f});
  c.model.head_chunks = head_chunks;
  Model model(c.model);
  ParamStore store(model, 0, model.size(), 5);  // the same seed: the same weights
  if (device == Device::cuda) store.to_device(dtype);
  Decoder decoder(model, 0, model.size(), 1, device, dtype);
  std::vector<std::vector<float>> out;
  std::vector<std::int32_t> host(ids);
  for (std::int64_t from = 0; from < static_cast<std::int64_t>(ids.size());) {
    const std::int64_t count = from == 0 ? 5 : 1;
    const Tensor x = decoder.input(count);
    ops::transfer(x, make_tensor(host.data() + from, Shape{1, count}));
    const Tensor z = decoder.forward(0, x, from);
    out.emplace_back(z.f32(), z.f32() + z.numel());
    from += count;
  }
  return out;
}

}  // namespace

TEST_CASE("cuda op: generation's logits on the GPU match the CPU's token by token (fp32, bf16; both heads)") {
  std::vector<std::int32_t> ids(20);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 37 + 11) % 96);
  for (const int chunks : {1, 3}) {
    const auto cpu = decode_all(chunks, Device::cpu, DType::f32, ids);
    for (const DType dtype : {DType::f32, DType::bf16}) {
      CAPTURE(chunks);
      CAPTURE(to_string(dtype));
      const auto gpu = decode_all(chunks, Device::cuda, dtype, ids);
      REQUIRE(gpu.size() == cpu.size());
      double worst = 0, scale = 0;
      int agree = 0, apart = 0;
      for (std::size_t p = 0; p < cpu.size(); ++p) {
        for (std::size_t v = 0; v < cpu[p].size(); ++v) {
          worst = std::max(worst, static_cast<double>(std::fabs(gpu[p][v] - cpu[p][v])));
          scale = std::max(scale, static_cast<double>(std::fabs(cpu[p][v])));
        }
        std::vector<float> sorted = cpu[p];
        std::sort(sorted.begin(), sorted.end(), std::greater<>());
        if (sorted[0] - sorted[1] > 0.05f * scale) {  // a clear best token: both pick it
          ++apart;
          const auto best = [](const std::vector<float>& z) { return std::max_element(z.begin(), z.end()) - z.begin(); };
          agree += best(cpu[p]) == best(gpu[p]) ? 1 : 0;
        }
      }
      CHECK(scale > 0);
      CHECK(worst <= (dtype == DType::f32 ? 1e-4 : 0.05) * std::max(scale, 1.0));
      CHECK(agree == apart);
    }
  }
}
