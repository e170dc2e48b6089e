// Tokenizers: byte-level BPE on a tokenizer.json written here, SentencePiece on a model
// spm_train learns here from the docs' text, round trips on random bytes and Unicode,
// streaming decode, the errors of files that are not tokenizers, and a tokenizer kept in
// a checkpoint file (io/checkpoint_tokenizer.hpp) and loaded back from its bytes.
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "mpipe/app/tokenize.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/data/hdf5.hpp"
#include "mpipe/io/checkpoint_format.hpp"
#include "mpipe/io/checkpoint_tokenizer.hpp"
#include "mpipe/text/bpe.hpp"
#include "mpipe/text/tokenizer.hpp"
#include "temp_dir.hpp"

namespace mpipe {
namespace {

std::string write_file(const std::string& name, const std::string& bytes) {
  const std::string path = testing::test_file(name).string();
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// Bytes b -> id b; merges "t h" (256), "th e" (257), "Ġ the" (258); <|endoftext|> 259.
std::string tiny_bpe_json(bool pair_merges) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level_text(std::string(1, static_cast<char>(b)))] = b;
  vocab["th"] = 256;
  vocab["the"] = 257;
  vocab[byte_level_text(" the")] = 258;
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& [a, b] : {std::pair{"t", "h"}, std::pair{"th", "e"}, std::pair{"Ġ", "the"}})
    merges.push_back(pair_merges ? nlohmann::json::array({a, b}) : nlohmann::json(cat(a, " ", b)));
  nlohmann::json j = {
      {"added_tokens", nlohmann::json::array({{{"id", 259}, {"content", "<|endoftext|>"}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
  return j.dump();
}

std::string random_bytes(std::mt19937& rng, std::size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

// Code points from several scripts, spaces and emoji, as UTF-8.
std::string random_unicode(std::mt19937& rng, std::size_t n) {
  const std::pair<char32_t, char32_t> ranges[] = {{0x20, 0x7e}, {0xa0, 0x24f}, {0x391, 0x3c9}, {0x410, 0x44f},
                                                  {0x4e00, 0x4fff}, {0x1f300, 0x1f64f}, {0x9, 0xa}};
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& [lo, hi] = ranges[rng() % std::size(ranges)];
    const char32_t c = lo + static_cast<char32_t>(rng() % (hi - lo + 1));
    if (c < 0x80) {
      s.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
      s.push_back(static_cast<char>(0xc0 | (c >> 6)));
      s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    } else if (c < 0x10000) {
      s.push_back(static_cast<char>(0xe0 | (c >> 12)));
      s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    } else {
      s.push_back(static_cast<char>(0xf0 | (c >> 18)));
      s.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
      s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    }
  }
  return s;
}

using Ids = std::vector<std::int32_t>;

TEST_CASE("byte-level BPE: a tokenizer.json's merges by rank, added tokens first, both merge forms") {
  for (const bool pairs : {false, true}) {
    const auto bpe = load_tokenizer(write_file(pairs ? "pairs.json" : "strings.json", tiny_bpe_json(pairs)));
    CHECK(bpe->vocab_size() == 260);
    CHECK(bpe->eot_id() == std::optional<std::int32_t>(259));
    CHECK(!bpe->bos_id().has_value());
    CHECK(bpe->file_name() == "tokenizer.json");
    CHECK(bpe->encode("the the") == Ids{257, 258});
    // "tthe": t, t, h, e; (t, h) merges first, then (th, e).
    CHECK(bpe->encode("tthe") == Ids{'t', 257});
    // The pre-tokenizer keeps "the" and "," apart; an added token is never merged.
    CHECK(bpe->encode("the,<|endoftext|>the") == Ids{257, ',', 259, 257});
    CHECK(bpe->encode("") == Ids{});
    CHECK(bpe->decode(Ids{257, 258, 259}) == "the the<|endoftext|>");
    CHECK_THROWS_AS(bpe->decode(Ids{260}), UserError);
    CHECK_THROWS_AS(bpe->decode(Ids{-1}), UserError);
  }
}

TEST_CASE("byte-level BPE: decode(encode(x)) = x on random bytes and random Unicode") {
  const auto bpe = load_tokenizer(write_file("round.json", tiny_bpe_json(false)));
  std::mt19937 rng(65);
  for (int trial = 0; trial < 20; ++trial) {
    const std::string bytes = random_bytes(rng, 1 + rng() % 2000), text = random_unicode(rng, 1 + rng() % 2000);
    CHECK(bpe->decode(bpe->encode(bytes)) == bytes);
    CHECK(bpe->decode(bpe->encode(text)) == text);
  }
}

// A SentencePiece model learnt by Debian's spm_train from docs/*.md: byte fallback and no
// normalisation, so that any Unicode text comes back as it went in.
std::string trained_sentencepiece() {
  static const std::string model = [] {
    std::string corpus;
    for (const char* page : {"architecture.md", "checkpoint-format.md"}) {
      std::ifstream in(std::string(MPIPE_TEST_SOURCE_DIR) + "/../docs/" + page);
      corpus += std::string(std::istreambuf_iterator<char>(in), {});
    }
    REQUIRE(corpus.size() > 10000);
    const std::string text = write_file("corpus.txt", corpus), prefix = testing::test_file("spm").string();
    const std::string command = cat("spm_train --input=", text, " --model_prefix=", prefix,
                                    " --vocab_size=400 --model_type=bpe --byte_fallback=true --character_coverage=1.0"
                                    " --normalization_rule_name=identity --remove_extra_whitespaces=false --minloglevel=2"
                                    " > /dev/null 2>&1");
    REQUIRE_MESSAGE(std::system(command.c_str()) == 0, "spm_train failed (apt-get install sentencepiece)");
    return prefix + ".model";
  }();
  return model;
}

TEST_CASE("SentencePiece: a model spm_train learns here, its specials, and decode(encode(x)) = x on random Unicode") {
  const auto sp = load_tokenizer(trained_sentencepiece());
  CHECK(sp->vocab_size() == 400);
  CHECK(sp->eot_id() == std::optional<std::int32_t>(2));  // spm_train's defaults: unk 0, bos 1, eos 2
  CHECK(sp->bos_id() == std::optional<std::int32_t>(1));
  CHECK(sp->file_name() == "tokenizer.model");
  const Ids ids = sp->encode("The pipeline stage");
  CHECK(ids.size() < std::string("The pipeline stage").size());  // merged pieces, not bytes
  CHECK(sp->decode(ids) == "The pipeline stage");
  std::mt19937 rng(66);
  for (int trial = 0; trial < 20; ++trial) {
    const std::string text = random_unicode(rng, 1 + rng() % 1000);
    CHECK(sp->decode(sp->encode(text)) == text);
  }
  CHECK_THROWS_AS(sp->decode(Ids{400}), UserError);
}

TEST_CASE("StreamDecoder gives out whole characters only, and all of decode's text in the end") {
  std::mt19937 rng(67);
  const std::string text = random_unicode(rng, 300);
  for (const std::string& file : {write_file("stream.json", tiny_bpe_json(true)), trained_sentencepiece()}) {
    const auto tokenizer = load_tokenizer(file);
    const Ids ids = tokenizer->encode(text);
    StreamDecoder stream(*tokenizer);
    std::string out;
    for (const std::int32_t id : ids) {
      const std::string part = stream.put(id);
      // Each part is whole UTF-8: it does not end inside a character.
      std::size_t lead = part.size();
      while (lead > 0 && (static_cast<unsigned char>(part[lead - 1]) & 0xc0) == 0x80) --lead;
      if (lead > 0) {
        const auto byte = static_cast<unsigned char>(part[lead - 1]);
        const std::size_t length = byte < 0x80 ? 1 : byte >= 0xf0 ? 4 : byte >= 0xe0 ? 3 : 2;
        CHECK(part.size() - (lead - 1) == length);
      }
      out += part;
    }
    out += stream.finish();
    CHECK(out == tokenizer->decode(ids));
  }
}

TEST_CASE("files that are not tokenizers: one UserError naming the file") {
  std::mt19937 rng(68);
  auto message = [](const std::string& path) {
    try {
      load_tokenizer(path);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const auto& [name, bytes] : {std::pair{"noise.bin", random_bytes(rng, 4096)}, std::pair{"empty.model", std::string()},
                                    std::pair{"wordpiece.json", std::string(R"({"model": {"type": "WordPiece", "vocab": {}}})")},
                                    std::pair{"broken.json", std::string("{\"model\": ")}}) {
    const std::string path = write_file(name, bytes);
    const std::string what = message(path);
    CAPTURE(what);
    CHECK(what.find(path) != std::string::npos);
  }
  CHECK(message(testing::test_file("absent.model").string()).find("no tokenizer file") != std::string::npos);
  std::filesystem::create_directories(testing::test_file("empty-dir"));
  CHECK(message(testing::test_file("empty-dir").string()).find("holds neither") != std::string::npos);
}

// A checkpoint keeps the tokenizer file's bytes (/tokenizer/file, uint8, name, kind,
// crc32): read back whole, loaded from memory it encodes as the file does; a file without
// one reads as none; a changed byte or a link in its place is refused by name.
TEST_CASE("a tokenizer kept in a checkpoint file reads back, loads from its bytes, and its damage is found") {
  quiet_hdf5();
  TokenizerFile kept;
  const auto from_file = load_run_tokenizer(trained_sentencepiece(), 512, &kept);
  CHECK(kept.kind == "sentencepiece");
  CHECK(kept.name == "spm.model");
  CHECK_THROWS_WITH_AS(load_run_tokenizer(trained_sentencepiece(), 300, &kept),
                       doctest::Contains("has 400 tokens, more than the model's vocabulary of 300"), UserError);
  const std::string path = testing::test_file("with-tokenizer.h5").string();
  {
    Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    REQUIRE(file.ok());
    std::string problem;
    CHECK_FALSE(read_checkpoint_tokenizer(file.get(), &problem).has_value());  // none: as every older checkpoint
    CHECK(problem.empty());
    write_checkpoint_tokenizer(file.get(), kept);
  }
  std::string problem;
  {
    Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    const std::optional<TokenizerFile> back = read_checkpoint_tokenizer(file.get(), &problem);
    REQUIRE_MESSAGE(back.has_value(), problem);
    CHECK(back->bytes == kept.bytes);
    CHECK(back->name == "spm.model");
    CHECK(back->kind == "sentencepiece");
    const auto from_bytes = tokenizer_from_bytes(back->bytes, "checkpoint");
    const std::string text = "The pipeline's stages send activations — ünïcode too.";
    CHECK(from_bytes->encode(text) == from_file->encode(text));
    CHECK(from_bytes->vocab_size() == from_file->vocab_size());
  }
  // One byte of the data changed, in place: its checksum fails.
  {
    Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    Handle set(H5Dopen2(file.get(), checkpoint_tokenizer_path, H5P_DEFAULT), H5Dclose);
    const haddr_t offset = H5Dget_offset(set.get());
    REQUIRE(offset != HADDR_UNDEF);
    std::fstream raw(path, std::ios::in | std::ios::out | std::ios::binary);
    raw.seekg(static_cast<std::streamoff>(offset + 1000));
    const char byte = static_cast<char>(raw.get());
    raw.seekp(static_cast<std::streamoff>(offset + 1000));
    raw.put(static_cast<char>(byte ^ 0x10));
  }
  {
    Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    CHECK_FALSE(read_checkpoint_tokenizer(file.get(), &problem).has_value());
    CHECK(problem == "the tokenizer /tokenizer/file fails its checksum (altered or damaged)");
  }
  // A soft link standing in for the data: refused, not followed.
  const std::string linked = testing::test_file("linked.h5").string();
  {
    Handle file(H5Fcreate(linked.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    write_checkpoint_tokenizer(file.get(), TokenizerFile{.name = "t.model", .kind = "sentencepiece", .bytes = kept.bytes},
                               true);
    REQUIRE(H5Lmove(file.get(), checkpoint_tokenizer_path, file.get(), "/elsewhere", H5P_DEFAULT, H5P_DEFAULT) >= 0);
    REQUIRE(H5Lcreate_soft("/elsewhere", file.get(), checkpoint_tokenizer_path, H5P_DEFAULT, H5P_DEFAULT) >= 0);
  }
  {
    Handle file(H5Fopen(linked.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    CHECK_FALSE(read_checkpoint_tokenizer(file.get(), &problem).has_value());
    CHECK(problem.find("is reached through a link") != std::string::npos);
  }
}

TEST_CASE("a BPE tokenizer.json kept in a checkpoint file: kind bpe, the same bytes, the same ids") {
  quiet_hdf5();
  TokenizerFile kept;
  const auto from_file = load_run_tokenizer(write_file("kept.json", tiny_bpe_json(true)), 260, &kept);
  CHECK(kept.kind == "bpe");
  CHECK(kept.name == "kept.json");
  const std::string path = testing::test_file("with-bpe.h5").string();
  {
    Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    write_checkpoint_tokenizer(file.get(), kept);
  }
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  std::string problem;
  const std::optional<TokenizerFile> back = read_checkpoint_tokenizer(file.get(), &problem);
  REQUIRE_MESSAGE(back.has_value(), problem);
  CHECK(back->kind == "bpe");
  CHECK(back->bytes == kept.bytes);
  CHECK(tokenizer_from_bytes(back->bytes, "checkpoint")->encode("the,<|endoftext|>the") ==
        from_file->encode("the,<|endoftext|>the"));
}

}  // namespace
}  // namespace mpipe
