// Token data: llm.c shards (uint16 and uint32), flat files, directories and globs read as
// one stream; windows inside one shard; documents packing; bad files refused by name.
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "mpipe/core/error.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/data/token_data.hpp"
#include "documented_rng.hpp"
#include "temp_dir.hpp"

using namespace mpipe;
namespace fs = std::filesystem;

namespace {

// A model of seq_len tokens and a vocabulary of `vocab`, as make_dataset gives them.
struct Gpt {
  std::int64_t vocab, seq_len;
};
Gpt gpt_of(std::int64_t vocab, std::int64_t seq_len) { return {vocab, seq_len}; }

std::unique_ptr<Dataset> token_data(const std::string& spec, const Gpt& model, std::uint64_t seed, bool held_out = false,
                                    const TokenOptions& options = {}) {
  const bool text = spec.rfind("text:", 0) == 0;
  return make_token_data(text, spec.substr(text ? 5 : 7), model.seq_len, model.vocab, seed, held_out, options);
}

void put_le(std::string& bytes, std::uint64_t value, int width) {
  for (int b = 0; b < width; ++b) bytes += static_cast<char>((value >> (8 * b)) & 0xff);
}

// An llm.c shard as data_common.py's write_datafile writes it; `count` overrides the
// header's token count (a bad shard).
fs::path write_shard(const fs::path& path, const std::vector<std::uint32_t>& ids, bool llama = false, std::int64_t count = -1,
                     std::int32_t magic = 0) {
  std::string bytes;
  put_le(bytes, static_cast<std::uint32_t>(magic ? magic : llama ? llama3_shard_magic : gpt2_shard_magic), 4);
  put_le(bytes, llama ? llama3_shard_version : gpt2_shard_version, 4);
  put_le(bytes, static_cast<std::uint64_t>(count >= 0 ? count : static_cast<std::int64_t>(ids.size())), 4);
  bytes.resize(shard_header_bytes, '\0');
  for (const std::uint32_t id : ids) put_le(bytes, id, llama ? 4 : 2);
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// Ids that say where they are: shard `shard`'s token i is shard * 1000 + i.
std::vector<std::uint32_t> placed(int shard, int n) {
  std::vector<std::uint32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(static_cast<std::uint32_t>(shard * 1000 + i));
  return ids;
}

struct Windows {
  std::vector<std::int32_t> inputs, targets;
  Windows(const Dataset& data, std::uint64_t first, int count, int T) : inputs(count * T), targets(count * T) {
    data.fill(first, count, make_tensor(inputs.data(), Shape{count, T}), make_tensor(targets.data(), Shape{count, T}));
  }
};

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("token shards: llm.c uint16 and uint32 shards read as their ids, targets the inputs shifted by one") {
  constexpr int T = 6;
  for (const bool llama : {false, true}) {
    CAPTURE(llama);
    // Llama 3's ids pass 65535: the uint32 ids are read whole.
    std::vector<std::uint32_t> ids;
    const std::uint32_t base = llama ? 128000 : 50000;
    for (std::uint32_t i = 0; i < 40; ++i) ids.push_back(base + i);
    const fs::path path = write_shard(mpipe::testing::test_file(llama ? "llama.bin" : "gpt2.bin"), ids, llama);
    auto data = token_data("tokens:" + path.string(), gpt_of(static_cast<int>(base) + 64, T), 7);
    CHECK(data->describe().find(llama ? "Llama 3 shard, uint32" : "GPT-2 shard, uint16") != std::string::npos);
    const Windows w(*data, 0, 16, T);
    for (int s = 0; s < 16; ++s) {
      const std::int32_t start = w.inputs[s * T] - static_cast<std::int32_t>(base);
      CHECK(start >= 0);
      CHECK(start + T < 40);  // the window's T + 1 tokens lie inside the shard
      for (int t = 0; t < T; ++t) {
        CHECK(w.inputs[s * T + t] == static_cast<std::int32_t>(base) + start + t);
        CHECK(w.targets[s * T + t] == static_cast<std::int32_t>(base) + start + t + 1);
      }
    }
  }
}

TEST_CASE("token shards: a directory and a glob are one stream in name order; windows never span two shards") {
  constexpr int T = 4;
  const fs::path dir = mpipe::testing::test_file("shards");
  // Lengths T + 1 (one window), T (none: too short) and 30; a file not named *.bin is not read.
  write_shard(dir / "train_002.bin", placed(2, 30));
  write_shard(dir / "train_000.bin", placed(0, T + 1));
  write_shard(dir / "train_001.bin", placed(1, T));
  std::ofstream(dir / "README") << "not a shard";
  const Gpt model = gpt_of(4096, T);
  for (const std::string& spec : {"tokens:" + dir.string(), "tokens:" + (dir / "train_*.bin").string()}) {
    CAPTURE(spec);
    auto data = token_data(spec, model, 3);
    CHECK(data->describe().find("3 shards") != std::string::npos);
    std::set<std::int32_t> starts;
    const Windows w(*data, 0, 2000, T);
    for (int s = 0; s < 2000; ++s) {
      const std::int32_t first = w.inputs[s * T];
      for (int t = 0; t < T; ++t) CHECK(w.targets[s * T + t] == first + t + 1);  // consecutive: one shard
      CHECK(first / 1000 != 1);                                                      // the short shard has no window
      CHECK((first % 1000) + T < (first / 1000 == 0 ? T + 1 : 30));
      starts.insert(first);
    }
    // Every window of the stream is drawn: 1 of shard 0 and 30 - T of shard 2.
    CHECK(starts.size() == 1 + 30 - T);
  }
  const bool listed_dir = [&] {
    bool listed = false;
    return token_files(dir.string(), "--data", listed) == std::vector<std::string>{(dir / "train_000.bin").string(),
                                                                                     (dir / "train_001.bin").string(),
                                                                                     (dir / "train_002.bin").string()} &&
           listed;
  }();
  CHECK(listed_dir);
}

TEST_CASE("token shards: held-out data is read in order, window i at token i T of the stream's shards") {
  constexpr int T = 4;
  const fs::path dir = mpipe::testing::test_file("held_out");
  write_shard(dir / "a.bin", placed(0, 13));  // windows at 0, 4, 8 (12 + T + 1 > 13)
  write_shard(dir / "b.bin", placed(1, 9));   // at 0, 4
  auto data = token_data("tokens:" + dir.string(), gpt_of(4096, T), 3, true);
  REQUIRE(data->size() == 5);
  const Windows w(*data, 0, 5, T);
  const std::vector<std::int32_t> expected{0, 4, 8, 1000, 1004};
  for (int s = 0; s < 5; ++s) CHECK(w.inputs[s * T] == expected[static_cast<std::size_t>(s)]);
}

TEST_CASE("token shards: documents packing starts every window at a document's start") {
  constexpr int T = 5;
  constexpr std::uint32_t eot = 999;
  // Documents of 3, 6 and 9 tokens in a shard, each ended by the end-of-text id; a second
  // shard starts a document at its offset 0.
  std::vector<std::uint32_t> one;
  for (const int length : {3, 6, 9}) {
    for (int i = 0; i < length; ++i) one.push_back(static_cast<std::uint32_t>(100 * length + i));
    one.push_back(eot);
  }
  const fs::path dir = mpipe::testing::test_file("documents");
  write_shard(dir / "0.bin", one);
  write_shard(dir / "1.bin", placed(2, 8));
  const Gpt model = gpt_of(4096, T);
  // Starts with T + 1 tokens before the shard's end: 0 and 4 and 11 of the first (21 is
  // too late: 10 tokens from there), 0 of the second.
  const std::set<std::int32_t> allowed{300, 600, 900, 2000};
  auto data = token_data("tokens:" + dir.string(), model, 5, false, {.packing = Packing::documents, .eot_id = eot});
  CHECK(data->describe().find("4 document starts") != std::string::npos);
  std::set<std::int32_t> seen;
  const Windows w(*data, 0, 400, T);
  for (int s = 0; s < 400; ++s) seen.insert(w.inputs[s * T]);
  CHECK(seen == allowed);
  // A window runs on across the end-of-text id into the next document (packing).
  bool crossed = false;
  for (int s = 0; s < 400; ++s)
    if (w.inputs[s * T] == 300) crossed = w.inputs[s * T + 3] == static_cast<std::int32_t>(eot) && w.inputs[s * T + 4] == 600;
  CHECK(crossed);
  // GPT-2 shards' default end-of-text id is 50256; flat files have none.
  auto by_default = token_data("tokens:" + dir.string(), gpt_of(50257, T), 5, false, {.packing = Packing::documents});
  CHECK(by_default->describe().find("end-of-text id 50256") != std::string::npos);
  std::string flat_bytes;
  for (int i = 0; i < 32; ++i) put_le(flat_bytes, static_cast<std::uint64_t>(i), 2);
  const fs::path flat = mpipe::testing::test_file("flat_documents.bin");
  std::ofstream(flat, std::ios::binary) << flat_bytes;
  CHECK(error_of([&] { token_data("tokens:" + flat.string(), model, 5, false, {.packing = Packing::documents}); })
            .find("needs --eot-id") != std::string::npos);
}

TEST_CASE("token shards: bad files are one user error naming the file") {
  const Gpt model = gpt_of(1024, 4);
  const auto error = [&](const std::string& spec, const TokenOptions& options = {}) {
    return error_of([&] { token_data(spec, model, 1, false, options); });
  };
  const fs::path bad_magic = write_shard(mpipe::testing::test_file("bad_magic/x.bin"), placed(0, 20), false, -1, 12345);
  CHECK(error("tokens:" + bad_magic.parent_path().string()) ==
        "token shard '" + bad_magic.string() + "' has a bad magic 12345 (not an llm.c shard)");
  const fs::path past = write_shard(mpipe::testing::test_file("past.bin"), placed(0, 20), false, 21);
  CHECK(error("tokens:" + past.string()).find("'" + past.string() + "' says 21 tokens (42 bytes after its header) but holds 40 bytes: "
                                              "the count is past its size") != std::string::npos);
  const fs::path truncated = mpipe::testing::test_file("truncated.bin");
  write_shard(truncated, {});
  fs::resize_file(truncated, 100);
  CHECK(error("tokens:" + truncated.string()).find("'" + truncated.string() + "' has a truncated header (100 of 1024 bytes)") !=
        std::string::npos);
  const fs::path version = write_shard(mpipe::testing::test_file("version.bin"), placed(0, 20), false);
  {
    std::fstream f(version, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4);
    f.put(7);
  }
  CHECK(error("tokens:" + version.string()).find("has version 7") != std::string::npos);
  const fs::path odd = mpipe::testing::test_file("odd_flat.bin");
  std::ofstream(odd, std::ios::binary) << "abcde";
  CHECK(error("tokens:" + odd.string()).find("'" + odd.string() + "' has an odd size (5 bytes)") != std::string::npos);
  const fs::path mixed = mpipe::testing::test_file("mixed");
  write_shard(mixed / "a.bin", placed(0, 20));
  write_shard(mixed / "b.bin", placed(0, 20), true);
  CHECK(error("tokens:" + mixed.string()).find("is a llm.c Llama 3 shard") != std::string::npos);
  CHECK(error("tokens:" + (mixed / "nothing_*.bin").string()).find("no file matches --data") != std::string::npos);
  fs::create_directories(mpipe::testing::test_file("empty_dir"));
  CHECK(error("tokens:" + mpipe::testing::test_file("empty_dir").string()).find("holds no .bin files") != std::string::npos);
  // An id past the vocabulary: said where a window reads it (or by the documents' pass).
  const fs::path big = write_shard(mpipe::testing::test_file("big_ids.bin"), std::vector<std::uint32_t>(20, 2000));
  auto data = token_data("tokens:" + big.string(), model, 1);
  CHECK(error_of([&] { Windows(*data, 0, 1, 4); }).find("data file '" + big.string() + "' holds token id 2000") != std::string::npos);
  CHECK(error("tokens:" + big.string(), {.packing = Packing::documents, .eot_id = 0}).find("holds token id 2000") != std::string::npos);
  std::string flat_big;
  for (int i = 0; i < 20; ++i) put_le(flat_big, 65535, 2);
  const fs::path flat = mpipe::testing::test_file("flat_big.bin");
  std::ofstream(flat, std::ios::binary) << flat_big;
  auto flat_data = token_data("tokens:" + flat.string(), model, 1);
  CHECK(error_of([&] { Windows(*flat_data, 0, 1, 4); }).find("holds token id 65535") != std::string::npos);
}

TEST_CASE("token shards: a shard changed under the run ends it at that batch, naming the file") {
  constexpr int T = 4;
  const fs::path dir = mpipe::testing::test_file("changing");
  write_shard(dir / "a.bin", placed(0, 50));
  const fs::path second = write_shard(dir / "b.bin", placed(1, 50));
  auto data = token_data("tokens:" + dir.string(), gpt_of(4096, T), 1);
  Windows(*data, 0, 8, T);
  // Rewritten in place, one byte longer: every window of the other shard still reads, the
  // first that reads this one fails.
  std::ofstream(second, std::ios::binary | std::ios::app) << 'x';
  const std::string what = error_of([&] { Windows(*data, 0, 64, T); });
  CHECK(what.find("data file '" + second.string() + "' changed while training read it") != std::string::npos);
}

TEST_CASE("token data: a run's windows follow the rule docs/data.md states, shards, documents and a flat file") {
  constexpr int T = 4;
  const std::uint64_t seed = 99;
  // The candidate index of sample s among P, exactly as the text states it.
  const auto documented_candidate = [&](std::uint64_t s, std::uint64_t P) {
    const auto w = mpipe::testing::documented_philox(
        {0u, static_cast<std::uint32_t>(s), static_cast<std::uint32_t>(s >> 32), 0u}, seed ^ (std::uint64_t{3} << 56));
    const std::uint64_t r = (std::uint64_t{w[0]} << 32) | w[1];
    __extension__ using u128 = unsigned __int128;  // the multiply-high the text states
    return static_cast<std::uint64_t>((static_cast<u128>(r) * P) >> 64);
  };
  const fs::path dir = mpipe::testing::test_file("rule");
  std::vector<std::uint32_t> first = placed(0, 23), second = placed(1, 12);
  first[6] = first[15] = second[3] = 999;  // end-of-text ids for the documents' rule
  write_shard(dir / "a.bin", first);
  write_shard(dir / "b.bin", second);
  std::string flat_bytes;
  for (const std::uint32_t id : first) put_le(flat_bytes, id, 2);
  const fs::path flat = mpipe::testing::test_file("rule_flat.bin");
  std::ofstream(flat, std::ios::binary) << flat_bytes;
  const Gpt model = gpt_of(4096, T);
  struct Case {
    std::string spec;
    Packing packing;
    std::vector<std::pair<int, int>> candidates;  // (shard, offset) in stream order
  };
  std::vector<Case> cases;
  Case windows{"tokens:" + dir.string(), Packing::windows, {}};
  for (int a = 0; a + T < 23; ++a) windows.candidates.emplace_back(0, a);
  for (int a = 0; a + T < 12; ++a) windows.candidates.emplace_back(1, a);
  cases.push_back(windows);
  // Starts: 0, after each end-of-text id (7, 16 of the first; 4 of the second), while
  // offset + T + 1 <= n (16 + 5 <= 23 yes; 4 + 5 <= 12 yes).
  cases.push_back({"tokens:" + dir.string(), Packing::documents, {{0, 0}, {0, 7}, {0, 16}, {1, 0}, {1, 4}}});
  Case single{"tokens:" + flat.string(), Packing::windows, {}};
  for (int a = 0; a + T < 23; ++a) single.candidates.emplace_back(0, a);
  cases.push_back(single);
  for (const Case& c : cases) {
    CAPTURE(c.spec);
    CAPTURE(static_cast<int>(c.packing));
    auto data = token_data(c.spec, model, seed, false, {.packing = c.packing, .eot_id = 999});
    const Windows w(*data, 5, 64, T);  // samples 5 .. 68
    for (int i = 0; i < 64; ++i) {
      const auto [shard, offset] = c.candidates[documented_candidate(5 + static_cast<std::uint64_t>(i), c.candidates.size())];
      const std::vector<std::uint32_t>& ids = shard == 0 ? first : second;
      for (int t = 0; t < T; ++t) {
        CHECK(w.inputs[static_cast<std::size_t>(i * T + t)] == static_cast<std::int32_t>(ids[static_cast<std::size_t>(offset + t)]));
        CHECK(w.targets[static_cast<std::size_t>(i * T + t)] == static_cast<std::int32_t>(ids[static_cast<std::size_t>(offset + t + 1)]));
      }
    }
  }
}

TEST_CASE("token shards: the last stage reads targets alone, the same as the first stage's, without the first's checks") {
  constexpr int T = 4;
  const fs::path path = write_shard(mpipe::testing::test_file("alone.bin"), placed(0, 40));
  auto data = token_data("tokens:" + path.string(), gpt_of(4096, T), 11);
  REQUIRE(data->targets_alone());
  const Windows both(*data, 3, 16, T);
  std::vector<std::int32_t> targets(16 * T);
  data->fill(3, 16, Tensor{}, make_tensor(targets.data(), Shape{16, T}));
  CHECK(targets == both.targets);
  // The first stage says a changed file (and a bad id); the last reads on, so that one rank says it.
  std::ofstream(path, std::ios::binary | std::ios::app) << 'x';
  CHECK_NOTHROW(data->fill(3, 16, Tensor{}, make_tensor(targets.data(), Shape{16, T})));
  CHECK(error_of([&] { Windows(*data, 3, 16, T); }).find("changed while training read it") != std::string::npos);
}
