// Token data (--data text:PATH | tokens:PATH): files of token ids, memory-mapped, read
// as one stream of shards. A tokens: PATH is one file (llm.c's shard format, told by
// its magic, or flat little-endian uint16 ids), a directory (its *.bin files, in name
// order) or a glob (its matches, in name order), every file of those two an llm.c
// shard. A sample is a window of seq_len + 1 tokens inside one shard (docs/data.md,
// "How a batch is made", states which).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpipe/data/dataset.hpp"

namespace mpipe {

// llm.c's shard header (dev/data/data_common.py): 256 little-endian int32, [0] the magic,
// [1] the version, [2] the token count; then the tokens.
inline constexpr std::int32_t gpt2_shard_magic = 20240520, gpt2_shard_version = 1;      // uint16 ids
inline constexpr std::int32_t llama3_shard_magic = 20240801, llama3_shard_version = 7;  // uint32 ids
inline constexpr std::uint64_t shard_header_bytes = 256 * 4;
// The end-of-text ids --data-packing documents takes unless --eot-id says: GPT-2's
// <|endoftext|> in uint16 shards, Llama 3's <|end_of_text|> in uint32 shards.
inline constexpr std::int64_t gpt2_eot_id = 50256, llama3_eot_id = 128001;

// The files a tokens: PATH names, in the order they are read; `listed`: from a directory
// or glob (each must then be an llm.c shard). UserError for a directory without *.bin
// files or a glob without a match.
std::vector<std::string> token_files(const std::string& path, const std::string& option, bool& listed);

// The data set of text:PATH (`text`: bytes as tokens) or tokens:PATH for a model of
// seq_len tokens and a vocabulary of `vocab`; UserError on a bad file or spec.
std::unique_ptr<Dataset> make_token_data(bool text, const std::string& path, std::int64_t seq_len, std::int64_t vocab,
                                         std::uint64_t seed, bool held_out, const TokenOptions& options);

}  // namespace mpipe
