// Byte-level BPE from a Hugging Face tokenizer.json (GPT-2's and Llama 3's kind).
#pragma once
#include <memory>
#include <string>

#include "mpipe/text/tokenizer.hpp"

namespace mpipe {

// The tokenizer `json` (a tokenizer.json's text) describes; `path` names it in errors
// (UserError: not JSON, not BPE, not byte-level, a bad split pattern).
std::unique_ptr<Tokenizer> make_bpe_tokenizer(const std::string& json, const std::string& path);

// `bytes` as a byte-level vocabulary writes them: GPT-2's byte-to-unicode map, UTF-8
// (a space is "Ġ").
std::string byte_level_text(std::string_view bytes);

}  // namespace mpipe
