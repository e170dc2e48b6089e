// Weights in other tools' files: float16 and bfloat16 read as float32 exactly; a sharded
// checkpoint's index checked against its shards (a shard missing is one line naming
// it); --init-from over Hugging Face's GPT-2 and Llama files (names with or without the
// base model's prefix, their buffers skipped, BF16 and F16, shards, a tied lm_head) loads
// the values the files hold; a config.json that disagrees is named with its field; the
// Llama table splits c_attn and c_fc by rows.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "local_trainer.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/io/init_from.hpp"
#include "mpipe/io/safetensors.hpp"
#include "mpipe/io/weights.hpp"
#include "temp_dir.hpp"
#include "tiny_gpt.hpp"

using namespace mpipe;

namespace {

namespace fs = std::filesystem;

// A tensor to write: raw bytes of a dtype.
struct Raw {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  const auto b = std::as_bytes(std::span<const T>(v));
  return {b.begin(), b.end()};
}

void write(const fs::path& path, const std::vector<Raw>& tensors) {
  std::vector<SafetensorsEntry> entries;
  for (const Raw& t : tensors) entries.push_back({t.name, t.dtype, t.shape, t.bytes});
  write_safetensors(path.string(), entries, {{"format", "pt"}});
}

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = testing::test_file(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

template <class F>
std::string problem(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::uint16_t to_bfloat16(float f) {  // round to nearest even (no NaN here)
  std::uint32_t b = std::bit_cast<std::uint32_t>(f);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<std::uint16_t>(b >> 16);
}

// Each exported tensor of `model` as random values in `dtype` ("BF16" or "F16"), under
// `name(exported name)`, and the float32 values the load must give.
struct Encoded {
  std::vector<Raw> raw;
  std::map<std::string, std::vector<float>> values;  // exported name -> as stored
};
template <class Name>
Encoded encode(const Model& model, const std::string& dtype, Name name, std::uint32_t seed) {
  std::mt19937 rng(seed);
  Encoded out;
  for (const ExportedTensor& t : exported_tensors(model)) {
    std::int64_t numel = 1;
    for (const std::int64_t d : t.shape) numel *= d;
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(numel));
    std::vector<float> values(bits.size());
    for (std::size_t i = 0; i < bits.size(); ++i) {
      if (dtype == "BF16") {
        bits[i] = to_bfloat16(std::normal_distribution<float>(0.0f, 0.5f)(rng));
        values[i] = bfloat16_to_float(bits[i]);
      } else {  // finite halves, subnormals and signed zeros among them
        bits[i] = static_cast<std::uint16_t>(rng() & 0xffffu);
        if (((bits[i] >> 10) & 0x1fu) == 0x1fu) bits[i] &= 0xbfffu;
        values[i] = half_to_float(bits[i]);
      }
    }
    out.raw.push_back({name(t.name), dtype, t.shape, bytes_of(bits)});
    out.values[t.name] = values;
  }
  return out;
}

// The values `exec` holds, as the export's tensors would carry them (each tensor's rows
// from its parameters' rows, Conv1D's transposed).
std::map<std::string, std::vector<float>> held(Executor& exec) {
  const Model& model = exec.model();
  std::map<std::pair<int, std::string>, std::vector<float>> params;
  for (const ParamEntry& e : exec.params().entries())
    if (!e.tied_copy) {
      const auto begin = exec.params().params().begin() + static_cast<std::ptrdiff_t>(e.param_offset);
      params[{e.layer, e.name}] = std::vector<float>(begin, begin + e.numel());
    }
  std::map<std::string, std::vector<float>> out;
  for (const ExportedTensor& t : exported_tensors(model)) {
    std::vector<float> v;
    for (const ExportedTensor::Part& p : t.parts) {
      const std::vector<float>& param = params.at({p.layer, p.param});
      std::int64_t rows = 0;
      for (const ParamSpec& spec : model.layer(p.layer).param_specs())
        if (spec.name == p.param) rows = spec.shape[0];
      const std::int64_t per_row = static_cast<std::int64_t>(param.size()) / rows;
      v.insert(v.end(), param.begin() + p.rows_begin * per_row, param.begin() + p.rows_end * per_row);
    }
    out[t.name] = t.transposed ? transposed(v, t.shape[1], t.shape[0]) : v;
  }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Hugging Face's index over `shards` (each a list of tensors) written beside them.
void write_sharded(const fs::path& dir, const std::vector<std::vector<Raw>>& shards) {
  Json map = Json::object();
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const std::string file = cat("model-0000", s + 1, "-of-0000", shards.size(), ".safetensors");
    write(dir / file, shards[s]);
    for (const Raw& t : shards[s]) map[t.name] = file;
  }
  write_text(dir / "model.safetensors.index.json", Json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump());
}

}  // namespace

TEST_CASE("float16 and bfloat16 read as float32, each value exactly; other dtypes are refused by name") {
  CHECK(half_to_float(0x3c00) == 1.0f);
  CHECK(half_to_float(0xc000) == -2.0f);
  CHECK(half_to_float(0x7bff) == 65504.0f);                     // the largest half
  CHECK(half_to_float(0x0001) == std::ldexp(1.0f, -24));        // the smallest subnormal
  CHECK(half_to_float(0x03ff) == std::ldexp(1023.0f, -24));     // the largest subnormal
  CHECK(half_to_float(0x0400) == std::ldexp(1.0f, -14));        // the smallest normal
  CHECK(std::bit_cast<std::uint32_t>(half_to_float(0x8000)) == 0x80000000u);  // -0
  CHECK(std::isinf(half_to_float(0xfc00)));
  CHECK(half_to_float(0xfc00) < 0);
  CHECK(std::isnan(half_to_float(0x7e00)));
#ifdef __FLT16_MANT_DIG__
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {  // every half against the compiler's conversion
    const float want = static_cast<float>(std::bit_cast<_Float16>(static_cast<std::uint16_t>(h)));
    const float got = half_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(want) ? !std::isnan(got) : std::bit_cast<std::uint32_t>(want) != std::bit_cast<std::uint32_t>(got)) {
      FAIL("half ", h, ": ", got, " where ", want);
    }
  }
#endif
  CHECK(bfloat16_to_float(0x3f80) == 1.0f);
  CHECK(bfloat16_to_float(0xc0a0) == -5.0f);
  CHECK(bfloat16_to_float(0x0001) == std::bit_cast<float>(0x00010000u));

  const std::vector<std::uint16_t> bf = {0x3f80, 0xc0a0, 0x0000, 0x8000}, half = {0x3c00, 0xc000, 0x0001, 0x7bff};
  const std::vector<std::int32_t> ints = {1, 2};
  const fs::path path = testing::test_file("halves.safetensors");
  write(path, {{"bf", "BF16", {2, 2}, bytes_of(bf)}, {"half", "F16", {4}, bytes_of(half)}, {"ints", "I32", {2}, bytes_of(ints)}});
  const SafetensorsFile file(path.string());
  CHECK(file.floats("bf") == std::vector<float>{1.0f, -5.0f, 0.0f, -0.0f});
  CHECK(std::signbit(file.floats("bf")[3]));
  CHECK(file.floats("half") == std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24), 65504.0f});
  const std::string said = problem([&] { file.floats("ints"); });
  CHECK(said.find("tensor 'ints' is I32, not F32, BF16 or F16") != std::string::npos);
}

TEST_CASE("a sharded checkpoint reads as one file; its index is checked against its shards") {
  const std::vector<float> a = {1, 2, 3, 4}, b = {5}, c = {6, 7};
  const fs::path dir = fresh_dir("sharded");
  write_sharded(dir, {{{"a", "F32", {2, 2}, bytes_of(a)}, {"b", "F32", {1}, bytes_of(b)}}, {{"c", "F32", {2}, bytes_of(c)}}});
  const std::string index = (dir / "model.safetensors.index.json").string();
  const SafetensorsSet set(index);
  REQUIRE(set.tensors().size() == 3);
  CHECK(set.floats("a") == a);
  CHECK(set.floats("c") == c);
  CHECK(set.tensors().at("a").shape == std::vector<std::int64_t>{2, 2});
  CHECK(set.file_of("c") == (dir / "model-00002-of-00002.safetensors").string());
  CHECK(set.file_of("b") == (dir / "model-00001-of-00002.safetensors").string());

  struct Case {
    const char* name;
    std::string weight_map;
    const char* says;
  };
  const std::string one = R"("a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors")";
  for (const Case& k : std::vector<Case>{
           {"a shard missing", one + R"(, "c": "model-00002-of-00002.safetensors", "d": "model-00003-of-00003.safetensors")",
            "names shard 'model-00003-of-00003.safetensors', which is not there"},
           {"a tensor in the wrong shard", one + R"(, "c": "model-00001-of-00002.safetensors")", "puts tensor 'c' in"},
           {"a shard's tensor not mapped", R"("a": "model-00001-of-00002.safetensors")", "holds tensor 'b', which"},
           {"a shard outside the directory", R"("a": "../model-00001-of-00002.safetensors")", "not a file beside the index"},
           {"a shard not a name", R"("a": 3)", "is not a file name"},
       }) {
    INFO(k.name);
    write_text(dir / "bad.safetensors.index.json", "{\"weight_map\": {" + k.weight_map + "}}");
    const std::string said = problem([&] { SafetensorsSet((dir / "bad.safetensors.index.json").string()); });
    CHECK(said.find(k.says) != std::string::npos);
    CHECK(said.find((dir / "bad.safetensors.index.json").string()) != std::string::npos);
    CHECK(said.find('\n') == std::string::npos);
  }
  write_text(dir / "bad.safetensors.index.json", "{\"weight_map\": [");
  CHECK(problem([&] { SafetensorsSet((dir / "bad.safetensors.index.json").string()); }).find("is not JSON") != std::string::npos);
  write_text(dir / "bad.safetensors.index.json", "{\"metadata\": {}}");
  CHECK(problem([&] { SafetensorsSet((dir / "bad.safetensors.index.json").string()); }).find("has no weight_map") !=
        std::string::npos);
}

TEST_CASE("--init-from Hugging Face GPT-2 files: without the prefix, its buffers, BF16 over two shards, a tied lm_head") {
  test::Trainer gpt(test::tiny_gpt({.layers = 2, .d_model = 8, .heads = 2, .seq_len = 4, .vocab = 16}));
  const Model& model = gpt.model();
  REQUIRE(weight_family(model) == WeightFamily::gpt2);
  const std::string prefix = "transformer.";
  // GPT2Model's own names (no "transformer."), as the Hub's gpt2 files have them.
  Encoded e = encode(model, "BF16", [&](const std::string& n) { return n.substr(0, prefix.size()) == prefix ? n.substr(prefix.size()) : n; }, 1);
  const std::vector<float> mask(16, 1.0f);
  std::vector<Raw> first(e.raw.begin(), e.raw.begin() + 5), second(e.raw.begin() + 5, e.raw.end());
  first.push_back({"h.0.attn.bias", "F32", {1, 1, 4, 4}, bytes_of(mask)});  // GPT-2's causal mask buffers
  second.push_back({"h.1.attn.masked_bias", "F32", {1}, bytes_of(std::vector<float>{-1e4f})});
  const fs::path dir = fresh_dir("gpt2-hf");
  write_sharded(dir, {first, second});
  load_weights(gpt, dir.string());
  const std::map<std::string, std::vector<float>> loaded = held(gpt);
  for (const auto& [name, values] : e.values) {
    INFO(name);
    CHECK(same_bits(loaded.at(name), values));
  }

  // lm_head.weight beside a tied model's token table: taken when it is the table, else refused.
  const fs::path tied = fresh_dir("gpt2-lm-head");
  std::vector<Raw> with_head = e.raw;
  const Raw& wte = *std::find_if(e.raw.begin(), e.raw.end(), [](const Raw& r) { return r.name == "wte.weight"; });
  with_head.push_back({"lm_head.weight", wte.dtype, wte.shape, wte.bytes});
  write(tied / "model.safetensors", with_head);
  CHECK(problem([&] { load_weights(gpt, tied.string()); }).empty());
  with_head.back().bytes[0] ^= std::byte{1};
  write(tied / "model.safetensors", with_head);
  CHECK(problem([&] { load_weights(gpt, tied.string()); }).find("'lm_head.weight' differs from 'wte.weight'") != std::string::npos);
  with_head.back().shape = {8, 16};
  write(tied / "model.safetensors", with_head);
  CHECK(problem([&] { check_weights(model, tied.string()); }).find("tensor 'lm_head.weight' is (8, 16), this model's is (16, 8)") !=
        std::string::npos);

  // Both names of one tensor; a tensor the model has not; a dtype it cannot read.
  const fs::path bad = fresh_dir("gpt2-bad");
  std::vector<Raw> twice = e.raw;
  twice.push_back(twice[0]);
  twice.back().name = prefix + twice[0].name;
  write(bad / "model.safetensors", twice);
  CHECK(problem([&] { check_weights(model, bad.string()); }).find("has both") != std::string::npos);
  std::vector<Raw> extra = e.raw;
  extra.push_back({"h.9.mlp.c_fc.weight", "F32", {1}, bytes_of(std::vector<float>{0})});
  write(bad / "model.safetensors", extra);
  CHECK(problem([&] { check_weights(model, bad.string()); }).find("has tensor 'h.9.mlp.c_fc.weight', which this model has not") !=
        std::string::npos);
  std::vector<Raw> ints = e.raw;
  ints[0].dtype = "I16";
  write(bad / "model.safetensors", ints);
  CHECK(problem([&] { check_weights(model, bad.string()); }).find("is I16, not F32, BF16 or F16") != std::string::npos);
  // A directory without weights.
  CHECK(problem([&] { check_weights(model, fresh_dir("empty").string()); }).find("without model.safetensors") != std::string::npos);
}

TEST_CASE("--init-from: a config.json beside the weights that disagrees with the model is named with its first field") {
  test::Trainer gpt(test::tiny_gpt({.layers = 2, .d_model = 8, .heads = 2, .seq_len = 4, .vocab = 16}));
  const Model& model = gpt.model();
  const fs::path dir = fresh_dir("gpt2-config");
  write(dir / "model.safetensors", encode(model, "BF16", [](const std::string& n) { return n; }, 2).raw);
  const Json mine = hf_config(model);
  CHECK(mine["architectures"][0] == "GPT2LMHeadModel");
  CHECK(mine["n_embd"] == 8);
  CHECK(mine["n_layer"] == 2);
  CHECK(mine["n_head"] == 2);
  CHECK(mine["n_positions"] == 4);
  CHECK(mine["vocab_size"] == 16);
  write_text(dir / "config.json", mine.dump());
  CHECK(problem([&] { check_weights(model, dir.string()); }).empty());
  // Only the fields it has (sizes), or Hugging Face's defaults (the rest).
  write_text(dir / "config.json", R"({"model_type": "gpt2", "n_embd": 8})");
  CHECK(problem([&] { check_weights(model, dir.string()); }).empty());
  struct Case {
    std::string config;
    const char* says;
  };
  for (const Case& k : std::vector<Case>{
           {R"({"model_type": "gpt2", "n_embd": 8, "n_head": 4})", "config.json' disagrees with this model: n_head is 4, this model's is 2"},
           {R"({"model_type": "llama"})", "model_type is \"llama\", this model's is \"gpt2\""},
           {R"({"n_embd": 8})", "model_type is null (absent), this model's is \"gpt2\""},
           {R"({"model_type": "gpt2", "activation_function": "relu"})", "activation_function is \"relu\""},
           {R"({"model_type": "gpt2", "layer_norm_epsilon": 1e-6})", "layer_norm_epsilon is 1e-06, this model's is 1e-05"},
           {R"({"model_type": "gpt2", "tie_word_embeddings": false})", "tie_word_embeddings is false"},
           {R"([1, 2])", "it is not a JSON object"},
           {R"({"model_type": )", "is not a config.json Hugging Face reads"},
       }) {
    INFO(k.config);
    write_text(dir / "config.json", k.config);
    const std::string said = problem([&] { check_weights(model, dir.string()); });
    CHECK(said.find(k.says) != std::string::npos);
    CHECK(said.find((dir / "config.json").string()) != std::string::npos);
    CHECK(said.find('\n') == std::string::npos);
  }
  // A file given by name is checked against the config.json beside it too.
  write_text(dir / "config.json", R"({"model_type": "gpt2", "n_layer": 3})");
  CHECK(problem([&] { check_weights(model, (dir / "model.safetensors").string()); }).find("n_layer is 3, this model's is 2") !=
        std::string::npos);
}

namespace {

TrainConfig tiny_llama(const std::string& tie, int head_chunks) {
  TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 16, .heads = 4, .seq_len = 4, .vocab = 32});
  c.model.kind = "llama";
  c.model.kv_heads = 2;
  c.model.ffn = 24;
  c.model.dropout = 0.0f;
  c.model.tie_embeddings = tie;
  c.model.head_chunks = head_chunks;
  return c;
}

bool llama_built() {
  if (find_layer_kind("rmsnorm")) return true;
  MESSAGE("not run: this build has no llama layers (rmsnorm) yet");
  return false;
}

}  // namespace

TEST_CASE("Llama's table: c_attn's rows are q, k, v; c_fc's gate, up; the head untied, tied or in chunks") {
  if (!llama_built()) return;
  const Model untied(tiny_llama("off", 1).model);
  REQUIRE(llama_layout(untied));
  CHECK_FALSE(gpt2_layout(untied));
  CHECK(weight_family(untied) == WeightFamily::llama);
  const std::vector<ExportedName> qkv = exported_names(untied, 2, "attn.c_attn.weight");
  REQUIRE(qkv.size() == 3);
  CHECK(qkv[0].name == "model.layers.1.self_attn.q_proj.weight");
  CHECK((qkv[0].rows_begin == 0 && qkv[0].rows_end == 16));
  CHECK(qkv[1].name == "model.layers.1.self_attn.k_proj.weight");
  CHECK((qkv[1].rows_begin == 16 && qkv[1].rows_end == 24));  // 2 kv heads of 4 channels
  CHECK(qkv[2].name == "model.layers.1.self_attn.v_proj.weight");
  CHECK((qkv[2].rows_begin == 24 && qkv[2].rows_end == 32));
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const ExportedTensor& t : exported_tensors(untied)) shapes[t.name] = t.shape;
  const std::map<std::string, std::vector<std::int64_t>> want = {
      {"model.embed_tokens.weight", {32, 16}},
      {"model.norm.weight", {16}},
      {"lm_head.weight", {32, 16}},
      {"model.layers.0.input_layernorm.weight", {16}},
      {"model.layers.0.post_attention_layernorm.weight", {16}},
      {"model.layers.0.self_attn.q_proj.weight", {16, 16}},
      {"model.layers.0.self_attn.k_proj.weight", {8, 16}},
      {"model.layers.0.self_attn.v_proj.weight", {8, 16}},
      {"model.layers.0.self_attn.o_proj.weight", {16, 16}},
      {"model.layers.0.mlp.gate_proj.weight", {24, 16}},
      {"model.layers.0.mlp.up_proj.weight", {24, 16}},
      {"model.layers.0.mlp.down_proj.weight", {16, 24}}};
  for (const auto& [name, shape] : want) {
    INFO(name);
    CHECK(shapes[name] == shape);
    CHECK(shapes.count(cat("model.layers.1.", name.substr(name.find("0.") + 2))) == (name.find("layers.0") != std::string::npos));
  }
  CHECK(shapes.size() == 3 + 2 * 9);
  const Json config = hf_config(untied);
  CHECK(config["architectures"][0] == "LlamaForCausalLM");
  CHECK(config["model_type"] == "llama");
  CHECK(config["hidden_size"] == 16);
  CHECK(config["intermediate_size"] == 24);
  CHECK(config["num_hidden_layers"] == 2);
  CHECK(config["num_attention_heads"] == 4);
  CHECK(config["num_key_value_heads"] == 2);
  CHECK(config["head_dim"] == 4);
  CHECK(config["max_position_embeddings"] == 4);
  CHECK(config["vocab_size"] == 32);
  CHECK(config["tie_word_embeddings"] == false);
  CHECK(config["hidden_act"] == "silu");
  CHECK(config["rope_theta"].get<double>() == 10000.0);
  CHECK(config["rms_norm_eps"].get<double>() == 1e-5);

  const Model tied(tiny_llama("on", 1).model);
  CHECK(llama_layout(tied));
  CHECK(hf_config(tied)["tie_word_embeddings"] == true);
  for (const ExportedTensor& t : exported_tensors(tied)) CHECK(t.name != "lm_head.weight");
  // Untied chunks of the vocabulary: one lm_head.weight of their rows.
  const Model chunked(tiny_llama("off", 3).model);
  REQUIRE(llama_layout(chunked));
  for (const ExportedTensor& t : exported_tensors(chunked))
    if (t.name == "lm_head.weight") {
      CHECK(t.shape == std::vector<std::int64_t>{32, 16});
      REQUIRE(t.parts.size() == 3);
      CHECK((t.parts[1].at == 10 && t.parts[2].at == 21));  // chunk c from c 32 / 3
    }
  // A tied Llama with chunks has no lm_head of its own either.
  CHECK(llama_layout(Model(tiny_llama("on", 2).model)));
}

TEST_CASE("--init-from Hugging Face Llama files: F16 with and without model., the head in chunks; config.json checked") {
  if (!llama_built()) return;
  for (const auto& [tie, chunks] : std::vector<std::pair<std::string, int>>{{"off", 1}, {"off", 3}, {"on", 2}}) {
    INFO(tie, " ", chunks);
    test::Trainer llama(tiny_llama(tie, chunks));
    const Model& model = llama.model();
    // Half the names without "model." (LlamaModel's own), lm_head.weight never has it.
    int k = 0;
    Encoded e = encode(model, "F16", [&](const std::string& n) { return k++ % 2 && n.starts_with("model.") ? n.substr(6) : n; }, 3);
    e.raw.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", "F32", {2}, bytes_of(std::vector<float>{1, 0.01f})});
    const fs::path dir = fresh_dir("llama-hf");
    write(dir / "model.safetensors", e.raw);
    write_text(dir / "config.json", hf_config(model).dump());
    load_weights(llama, dir.string());
    const std::map<std::string, std::vector<float>> loaded = held(llama);
    for (const auto& [name, values] : e.values) {
      INFO(name);
      CHECK(same_bits(loaded.at(name), values));
    }
    // config.json's fields, each disagreeing in turn.
    const Json mine = hf_config(model);
    for (const auto& [field, value, says] : std::vector<std::tuple<std::string, Json, std::string>>{
             {"num_key_value_heads", 4, "num_key_value_heads is 4, this model's is 2"},
             {"hidden_size", 32, "hidden_size is 32, this model's is 16"},
             {"num_hidden_layers", 3, "num_hidden_layers is 3"},
             {"vocab_size", 64, "vocab_size is 64"},
             {"intermediate_size", 48, "intermediate_size is 48, this model's is 24"},
             {"rope_theta", 500000.0, "rope_theta is 500000.0, this model's is 10000.0"},
             {"rms_norm_eps", 1e-6, "rms_norm_eps is 1e-06, this model's is 1e-05"},
             {"tie_word_embeddings", tie == "off", cat("tie_word_embeddings is ", tie == "off" ? "true" : "false")},
             {"rope_scaling", Json{{"rope_type", "llama3"}, {"factor", 8.0}}, "rope_scaling is {"},
         }) {
      INFO(field);
      Json config = mine;
      config[field] = value;
      write_text(dir / "config.json", config.dump());
      const std::string said = problem([&] { check_weights(model, dir.string()); });
      CHECK(said.find(cat("'", (dir / "config.json").string(), "' disagrees with this model: ", says)) != std::string::npos);
    }
    // RoPE's settings as newer files spell them, the default rotation spelt out, a field of a wrong type.
    Json rope = mine;
    rope.erase("rope_theta");
    rope["rope_scaling"] = Json{{"rope_type", "default"}};
    rope["rope_parameters"] = Json{{"rope_type", "default"}, {"rope_theta", 10000.0}};
    write_text(dir / "config.json", rope.dump());
    CHECK(problem([&] { check_weights(model, dir.string()); }).empty());
    rope["rope_parameters"]["rope_theta"] = 500000.0;
    write_text(dir / "config.json", rope.dump());
    CHECK(problem([&] { check_weights(model, dir.string()); }).find("rope_theta is 500000.0 (absent") != std::string::npos);
    rope["rope_parameters"]["rope_theta"] = 10000.0;
    rope["rope_scaling"] = Json{{"rope_type", 3}};
    write_text(dir / "config.json", rope.dump());
    CHECK(problem([&] { check_weights(model, dir.string()); }).find("is not a config.json Hugging Face reads") != std::string::npos);
    // Fields left to Hugging Face's defaults: a tied model's config must say so, a kv-head count too.
    Json sparse = {{"model_type", "llama"}, {"hidden_size", 16}, {"num_attention_heads", 4}, {"rms_norm_eps", 1e-5},
                   {"num_key_value_heads", 2}};
    write_text(dir / "config.json", sparse.dump());
    const std::string said = problem([&] { check_weights(model, dir.string()); });
    if (tie == "on")
      CHECK(said.find("tie_word_embeddings is false (absent: Hugging Face's default), this model's is true") != std::string::npos);
    else
      CHECK(said.empty());
    sparse.erase("num_key_value_heads");
    sparse["tie_word_embeddings"] = tie == "on";
    write_text(dir / "config.json", sparse.dump());
    CHECK(problem([&] { check_weights(model, dir.string()); }).find("num_key_value_heads is 4 (absent: Hugging Face's default), this model's is 2") !=
          std::string::npos);
  }
}

TEST_CASE("--init-from: an untied Llama from tied weights (no lm_head.weight) says so; a tied one takes an equal lm_head") {
  if (!llama_built()) return;
  const Model untied(tiny_llama("off", 1).model), tied(tiny_llama("on", 1).model);
  const fs::path dir = fresh_dir("llama-tie");
  Encoded e = encode(tied, "BF16", [](const std::string& n) { return n; }, 4);
  write(dir / "model.safetensors", e.raw);
  CHECK(problem([&] { check_weights(tied, dir.string()); }).empty());
  CHECK(problem([&] { check_weights(untied, dir.string()); }).find("has no tensor 'lm_head.weight'") != std::string::npos);
  e.raw.push_back(e.raw[0]);  // embed_tokens' values as lm_head.weight
  e.raw.back().name = "lm_head.weight";
  write(dir / "model.safetensors", e.raw);
  test::Trainer llama(tiny_llama("on", 1));
  CHECK(problem([&] { load_weights(llama, dir.string()); }).empty());
  CHECK(problem([&] { check_weights(untied, dir.string()); }).empty());  // untied: lm_head is its own
}
