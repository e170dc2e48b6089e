// The tokenizer reference test's driver (check_tokenizer.py): encodes a file's bytes,
// whole, to little-endian int32 ids, or decodes such ids to bytes, through mpipe's
// tokenizers, for a Python twin to compare.
//   tokenizer_dump encode TOKENIZER TEXT OUT
//   tokenizer_dump decode TOKENIZER IDS OUT
#include <cstdio>
#include <cstring>
#include <fstream>

#include "mpipe/core/error.hpp"
#include "mpipe/text/tokenizer.hpp"

int main(int argc, char** argv) {
  if (argc != 5 || (std::strcmp(argv[1], "encode") != 0 && std::strcmp(argv[1], "decode") != 0)) {
    std::fprintf(stderr, "usage: tokenizer_dump encode|decode TOKENIZER IN OUT\n");
    return 2;
  }
  try {
    const auto tokenizer = mpipe::load_tokenizer(argv[2]);
    const std::string in = mpipe::read_whole_file(argv[3], "input");
    std::string out;
    if (std::strcmp(argv[1], "encode") == 0) {
      for (const std::int32_t id : tokenizer->encode(in))
        for (int b = 0; b < 4; ++b) out.push_back(static_cast<char>(static_cast<std::uint32_t>(id) >> (8 * b)));
    } else {
      std::vector<std::int32_t> ids(in.size() / 4);
      for (std::size_t i = 0; i < ids.size(); ++i)
        for (int b = 0; b < 4; ++b) ids[i] |= static_cast<std::int32_t>(static_cast<unsigned char>(in[4 * i + static_cast<std::size_t>(b)]) << (8 * b));
      out = tokenizer->decode(ids);
    }
    std::ofstream file(argv[4], std::ios::binary);
    file.write(out.data(), static_cast<std::streamsize>(out.size()));
    return file.good() ? 0 : 1;
  } catch (const mpipe::UserError& e) {
    std::fprintf(stderr, "tokenizer_dump: error: %s; hint: %s\n", e.what(), e.hint().c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_dump: %s\n", e.what());
    return 1;
  }
}
