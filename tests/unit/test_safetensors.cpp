// safetensors files: what write_safetensors writes reads back the same bits, and a file
// whose header lies (a length past the end, offsets outside the data or overlapping,
// sizes that do not match the shape, bad JSON, a truncated file) is a user error naming
// the problem, before any of its data is trusted. And the names mpipe export gives.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "mpipe/core/error.hpp"
#include "mpipe/app/config.hpp"
#include "mpipe/io/safetensors.hpp"
#include "mpipe/io/weights.hpp"
#include "temp_dir.hpp"
#include "tiny_gpt.hpp"

using namespace mpipe;

namespace {

// A file of `header` (JSON, as given) and `data` bytes; `length` overrides the header's.
std::string raw_file(const std::string& name, const std::string& header, std::size_t data_bytes,
                     std::int64_t length = -1) {
  const std::string path = testing::test_file(name).string();
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t n = length >= 0 ? static_cast<std::uint64_t>(length) : header.size();
  out.write(reinterpret_cast<const char*>(&n), sizeof n);
  out << header;
  out << std::string(data_bytes, '\0');
  return path;
}

std::string problem(const std::string& path) {
  try {
    SafetensorsFile file(path);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a safetensors file written reads back: names, shapes, metadata and the same bits") {
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -0.0f}, b = {7.0f};
  const std::string path = testing::test_file("round.safetensors").string();
  const std::int64_t count = 42;
  write_safetensors(path,
                    {f32_entry("layer.weight", {2, 3}, a), f32_entry("scalar_like", {1}, b),
                     {"count", "I64", {}, std::as_bytes(std::span<const std::int64_t>(&count, 1))}},
                    {{"format", "pt"}, {"step", "12"}});
  const SafetensorsFile file(path);
  REQUIRE(file.tensors().size() == 3);
  CHECK(file.tensors().at("count").dtype == "I64");
  CHECK(file.tensors().at("count").shape.empty());  // a scalar
  CHECK(file.tensors().at("layer.weight").shape == std::vector<std::int64_t>{2, 3});
  CHECK(file.tensors().at("layer.weight").dtype == "F32");
  CHECK(file.metadata().at("step") == "12");
  const std::vector<float> back = file.floats("layer.weight");
  REQUIRE(back.size() == a.size());
  CHECK(std::memcmp(back.data(), a.data(), a.size() * sizeof(float)) == 0);  // -0.0 and the denormal too
  CHECK(file.floats("scalar_like") == b);
  // The header is padded to 8 bytes (the format's alignment), the data follows it.
  std::ifstream in(path, std::ios::binary);
  std::uint64_t length = 0;
  in.read(reinterpret_cast<char*>(&length), sizeof length);
  CHECK(length % 8 == 0);
  // Nothing is left beside it (the temporary was renamed into place).
  CHECK_FALSE(std::filesystem::exists(path + ".tmp-" + std::to_string(::getpid())));
}

TEST_CASE("a safetensors file whose header lies is refused by name, before its data is read") {
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  CHECK(problem(raw_file("ok.safetensors", ok, 8)).empty());
  struct Case {
    const char* name;
    std::string header;
    std::size_t data;
    std::int64_t length;
    const char* says;
  };
  for (const Case& c : std::vector<Case>{
           {"empty header", "", 0, -1, "not JSON"},
           {"length past the end", ok, 8, 1 << 20, "its header says"},
           {"huge length", ok, 8, std::int64_t{1} << 60, "its header says"},
           {"not json", "{\"w\": [", 8, -1, "not JSON"},
           {"not an object", "[1, 2]", 8, -1, "not a JSON object"},
           {"no offsets", R"({"w":{"dtype":"F32","shape":[2]}})", 8, -1, "lacks"},
           {"unknown dtype", R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8, -1, "unknown dtype"},
           {"negative dim", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, -1, "dimension"},
           {"huge dims", R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8, -1, "dimension"},
           {"past the data", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, -1, "truncated"},
           {"size not the shape's", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, -1, "bytes for 3"},
           {"overlap", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
            8, -1, "share bytes"},
           {"a gap", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, -1, "no tensor names"},
           {"bytes left over", ok, 12, -1, "after the last tensor"},
           {"metadata not strings", R"({"__metadata__":{"step":12}})", 0, -1, "not a string"},
       }) {
    INFO(c.name);
    const std::string said = problem(raw_file(std::string(c.name) + ".safetensors", c.header, c.data, c.length));
    CHECK(said.find(c.says) != std::string::npos);
    CHECK(said.find('\n') == std::string::npos);
  }
  CHECK(problem(testing::test_file("missing.safetensors").string()).find("does not exist") != std::string::npos);
  {
    std::ofstream(testing::test_file("short.safetensors"), std::ios::binary) << "abc";
    CHECK(problem(testing::test_file("short.safetensors").string()).find("too short") != std::string::npos);
  }
  // A float read of another dtype is refused by name (F16 and BF16 read: test_weights.cpp).
  const SafetensorsFile ints(raw_file("ints.safetensors", R"({"h":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})", 8));
  CHECK_THROWS_AS(ints.floats("h"), UserError);
}

TEST_CASE("exported names: GPT-2's for the GPT preset (Conv1D transposed), torchvision's for the ResNet preset, else the layer list's") {
  const Model g(test::tiny_gpt({.layers = 2, .d_model = 8, .heads = 2, .seq_len = 4, .vocab = 16}).model);  // embedding, 2 blocks, layernorm, head, loss
  CHECK(gpt2_layout(g));
  CHECK_FALSE(torchvision_resnet_layout(g));
  CHECK(exported_name(g, 0, "wte").name == "transformer.wte.weight");
  CHECK(exported_name(g, 2, "attn.c_attn.weight").name == "transformer.h.1.attn.c_attn.weight");
  CHECK(exported_name(g, 2, "attn.c_attn.weight").transposed);
  CHECK_FALSE(exported_name(g, 2, "attn.c_attn.bias").transposed);
  CHECK(exported_name(g, 3, "bias").name == "transformer.ln_f.bias");
  ModelConfig resnet;
  resnet.kind = "resnet";
  resnet.layers = 18;
  resnet.width = 4;
  resnet.image = 8;
  resnet.classes = 3;
  const Model r(resnet);  // conv, bn, relu, 8 x (block, relu), pool, fc, loss
  CHECK(torchvision_resnet_layout(r));
  CHECK(exported_name(r, 0, "weight").name == "conv1.weight");
  CHECK(exported_name(r, 1, "running_var").name == "bn1.running_var");
  CHECK(exported_name(r, 3, "0.weight").name == "layer1.0.conv1.weight");
  CHECK(exported_name(r, 5, "4.running_mean").name == "layer1.1.bn2.running_mean");
  CHECK(exported_name(r, 7, "skip.weight").name == "layer2.0.downsample.0.weight");
  CHECK(exported_name(r, 7, "skip_norm.bias").name == "layer2.0.downsample.1.bias");
  CHECK(exported_name(r, 17, "3.weight").name == "layer4.1.conv2.weight");
  CHECK(exported_name(r, r.size() - 2, "bias").name == "fc.bias");
  ModelConfig mlp;
  mlp.kind = "mlp";
  mlp.layers = 1;
  mlp.hidden = 4;
  mlp.inputs = 3;
  mlp.classes = 2;
  const Model m(mlp);
  CHECK_FALSE(gpt2_layout(m));
  CHECK_FALSE(torchvision_resnet_layout(m));
  CHECK(exported_name(m, 2, "weight").name == "2.weight");
  // [2, 3] -> [3, 2] and back.
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  CHECK(transposed(a, 2, 3) == std::vector<float>{1, 4, 2, 5, 3, 6});
  CHECK(transposed(transposed(a, 2, 3), 3, 2) == a);
}
