// `mpipe tokenize`: text files to llm.c-format token shards (docs/tokenizers.md).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpipe/io/checkpoint_tokenizer.hpp"
#include "mpipe/text/tokenizer.hpp"

namespace mpipe {

// llm.c's token shard (dev/data/data_common.py): a header of 256 little-endian int32,
// [0] magic, [1] version, [2] token count, then the tokens. GPT-2's kind holds uint16
// ids, Llama 3's uint32.
struct ShardKind {
  std::int32_t magic, version, token_bytes;
};
inline constexpr ShardKind kShardUint16{20240520, 1, 2};
inline constexpr ShardKind kShardUint32{20240801, 7, 4};
inline constexpr int kShardHeaderInts = 256;
// The kind that holds a vocabulary's ids: uint16 while they fit.
inline ShardKind shard_kind_for(std::int64_t vocab) { return vocab <= 65536 ? kShardUint16 : kShardUint32; }

struct TokenizeOptions {
  std::string tokenizer;             // a tokenizer file, or a directory holding one
  std::vector<std::string> inputs;   // text files; "-": standard input
  std::string out;                   // the shards' directory (created if missing)
  std::string prefix = "tokens";     // shard names: OUT/PREFIX_000000.bin, ...
  std::string document_separator;    // empty: each input is one document
  std::int64_t shard_size = 100000000;  // tokens per shard (llm.c's 1e8)
  int threads = 0;                   // 0: the cores this process may use
  std::int64_t eot_id = -1;          // -1: the tokenizer's end-of-text id
  bool bos = false;                  // also begin each document with the BOS id
  std::string progress = "auto";     // a live line on standard error: auto (a terminal), on, off
};

// Returns the exit code; UserError for bad options, inputs or a failed write.
int run_tokenize(const TokenizeOptions& options);

// A tokenizer fits a model whose vocabulary has `vocab` ids when its ids are all below it:
// UserError naming `source` (the file, or the checkpoint that holds it) otherwise.
void require_tokenizer_fits(const Tokenizer& tokenizer, const std::string& source, std::int64_t vocab);
// train --tokenizer: the file loaded and checked against the model's vocabulary, and
// what each checkpoint keeps of it (*kept: its base name, kind and bytes).
std::unique_ptr<Tokenizer> load_run_tokenizer(const std::string& path, std::int64_t vocab, TokenizerFile* kept);

}  // namespace mpipe
