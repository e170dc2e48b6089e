// The tokenizer a run trained with, kept in its checkpoints (docs/checkpoint-format.md,
// "The tokenizer"): the file's bytes as one uint8 dataset, /tokenizer/file, with its
// name, its kind and the CRC-32 every dataset carries. Optional: a checkpoint without
// one (every one before it, and runs without --tokenizer) is as valid as before.
// No MPI; the bytes are whatever the tokenizer file holds (text/ reads them).
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>

namespace mpipe {

inline constexpr const char* checkpoint_tokenizer_path = "/tokenizer/file";

struct TokenizerFile {
  std::string name;   // the file's base name as given (e.g. tokenizer.model, my.model)
  std::string kind;   // sentencepiece | bpe
  std::string bytes;  // the file, whole
  std::string source; // where it was read from, for messages (not kept in the checkpoint)
  std::uint32_t crc32() const;
};

// Creates /tokenizer/file in an open checkpoint (collective in a parallel file: every
// writer calls it); its bytes go in only where `write_data` (one writer).
void write_checkpoint_tokenizer(hid_t file, const TokenizerFile& tokenizer, bool write_data = true);
// Whether the file holds a tokenizer (a /tokenizer link at all).
bool has_checkpoint_tokenizer(hid_t file);
// The tokenizer the file holds, its bytes checked against their CRC-32; nothing when it
// holds none. `problem` is set (and nothing returned) when the dataset breaks a rule:
// not hard-linked, not a 1-D uint8 dataset, no checksum or name, or failing it.
std::optional<TokenizerFile> read_checkpoint_tokenizer(hid_t file, std::string* problem);

}  // namespace mpipe
