// mpipe's SentencePiece encoder (text/sentencepiece_encoder.hpp) against the library it
// replaces: Debian's libsentencepiece, SentencePieceProcessor::Encode, on unigram and BPE
// models spm_train learns here from the docs' text (NFKC or identity normalisation, byte
// fallback or not, user-defined symbols, no dummy prefix, whitespace as suffix) and on
// models written here (large, UNUSED pieces, tied scores), on the docs' paragraphs and on
// thousands of random strings made to hit normalisation's corners. Every id must be the
// library's; the tests also check that the strings did reach those corners (unknown
// pieces, byte pieces, user-defined pieces, text NFKC changes), so that equality means
// something.
#include <doctest/doctest.h>

#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "mpipe/core/error.hpp"
#include "mpipe/text/sentencepiece_encoder.hpp"
#include "mpipe/text/tokenizer.hpp"
#include "temp_dir.hpp"

namespace mpipe {
namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string docs_text() {
  std::string text;
  for (const char* page : {"architecture.md", "checkpoint-format.md", "tokenizers.md"})
    text += read_bytes(std::string(MPIPE_TEST_SOURCE_DIR) + "/../docs/" + page);
  REQUIRE(text.size() > 20000);
  return text;
}

// A model spm_train learns from the docs' text with `options`; its path (learnt once a run).
std::string train(const std::string& name, const std::string& options) {
  static std::map<std::string, std::string> learnt;
  if (const auto it = learnt.find(name + options); it != learnt.end()) return it->second;
  const std::string corpus = testing::test_file("spm-corpus.txt").string();
  std::ofstream(corpus, std::ios::binary) << docs_text();
  const std::string prefix = testing::test_file("spm-" + name).string();
  const std::string command = cat("spm_train --input=", corpus, " --model_prefix=", prefix,
                                  " --vocab_size=800 --minloglevel=2 ", options, " > /dev/null 2>&1");
  REQUIRE_MESSAGE(std::system(command.c_str()) == 0, "spm_train failed (apt-get install sentencepiece): ", command);
  return learnt[name + options] = prefix + ".model";
}

void put_utf8(std::string& s, char32_t c) {
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xc0 | c >> 6);
    s += static_cast<char>(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    s += static_cast<char>(0xe0 | c >> 12);
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (c & 0x3f));
  } else {
    s += static_cast<char>(0xf0 | c >> 18);
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (c & 0x3f));
  }
}

// Strings of the docs' text, and characters normalisation treats specially: control
// characters, tabs, newlines, runs of spaces (leading and trailing too), no-break and
// ideographic spaces, combining marks, fullwidth forms, ligatures, circled and squared
// forms, a character NFKC expands to 18, Hangul, CJK, emoji, U+FFFD and its neighbours,
// and bytes that are not UTF-8 (stray continuation bytes, cut sequences, overlong forms,
// surrogates).
std::string random_text(std::mt19937& rng, const std::string& docs, const std::vector<std::string>& extra) {
  static const std::pair<char32_t, char32_t> ranges[] = {
      {0x20, 0x7e},     {0x00, 0x1f},     {0x7f, 0xa0},     {0xa0, 0x24f},   {0x300, 0x36f},   {0xff01, 0xff5e},
      {0x3000, 0x3000}, {0x2000, 0x200f}, {0x4e00, 0x4e20}, {0x1f300, 0x1f320}, {0xfb00, 0xfb06}, {0x2460, 0x2473},
      {0xfdfa, 0xfdfb}, {0x3300, 0x3357}, {0xac00, 0xac10}, {0x1100, 0x1112},  {0xfff0, 0xffff}, {0x2028, 0x2029}};
  constexpr int kRanges = sizeof ranges / sizeof ranges[0];
  static const char* const broken[] = {"\x80", "\xbf", "\xc3", "\xe2\x96", "\xf0\x9f\x8c", "\xc0\x80", "\xe0\x80\x80",
                                       "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xfe", "\xff", "\xf8\x88\x80\x80\x80"};
  std::string s;
  if (rng() % 4 == 0) s.append(1 + rng() % 3, rng() % 2 ? ' ' : '\t');
  const int n = static_cast<int>(rng() % 30);
  for (int i = 0; i < n; ++i) {
    const int k = static_cast<int>(rng() % (kRanges + 6));
    if (k < kRanges) {
      const auto [a, b] = ranges[k];
      put_utf8(s, a + static_cast<char32_t>(rng() % (b - a + 1)));
    } else if (k == kRanges) {
      s.append(1 + rng() % 5, ' ');
    } else if (k == kRanges + 1) {
      s += broken[rng() % (sizeof broken / sizeof broken[0])];
    } else if (k == kRanges + 2 && !extra.empty()) {
      s += extra[rng() % extra.size()];
    } else {
      s += docs.substr(rng() % docs.size(), rng() % 16);
    }
  }
  if (rng() % 4 == 0) s.append(1 + rng() % 3, rng() % 2 ? ' ' : '\n');
  return s;
}

struct Counts {
  std::size_t texts = 0, ids = 0, unknown = 0, bytes = 0, user_defined = 0;
};

// Our ids against the library's, for `model` on the docs' paragraphs, fixed corner cases
// and `random` random strings; what the texts reached.
Counts compare(const std::string& model, int random, const std::vector<std::string>& extra = {}) {
  const std::string bytes = read_bytes(model);
  sentencepiece::SentencePieceProcessor library;
  REQUIRE(library.LoadFromSerializedProto(bytes).ok());
  std::string why;
  const auto ours = SentencePieceEncoder::from_model(bytes, &why);
  REQUIRE_MESSAGE(ours != nullptr, why);

  std::vector<std::string> texts = {"", " ", "   ", "\t", "\n", "a", " a", "a ", "  a  b  ", "a\tb", "a\xff b",
                                    "\xef\xbf\xbd", "\xe3\x80\x80x\xe3\x80\x80", "\xef\xbd\x88\xef\xbd\x85",
                                    "e\xcc\x81", "\xef\xb7\xba", "1000000 0000", "the pipeline's stage"};
  const std::string docs = docs_text();
  for (std::size_t p = 0; p < docs.size();) {
    const std::size_t q = std::min(docs.find("\n\n", p), docs.size());
    texts.push_back(docs.substr(p, q - p));
    p = q + 2;
  }
  texts.push_back(docs);
  std::mt19937 rng(65);
  for (int i = 0; i < random; ++i) texts.push_back(random_text(rng, docs, extra));

  Counts counts;
  std::vector<std::int32_t> got;
  std::string normalized;
  for (const std::string& text : texts) {
    std::vector<int> want;
    REQUIRE(library.Encode(text, &want).ok());
    got.clear();
    CHECK(ours->encode(text, &got));
    ++counts.texts;
    counts.ids += want.size();
    if (std::vector<int>(got.begin(), got.end()) != want) {
      std::string hex;
      for (const unsigned char c : text.substr(0, 200)) hex += cat(" ", static_cast<int>(c));
      FAIL_CHECK("ids differ from the library's on text of bytes", hex, " (", want.size(), " ids, ours ", got.size(), ")");
    }
    for (const int id : want) {
      counts.unknown += library.IsUnknown(id);
      counts.bytes += library.IsByte(id);
    }
    for (const std::string& symbol : extra)
      for (const int id : want) counts.user_defined += library.IdToPiece(id) == symbol;
    // Without byte fallback the library's pieces are the normalised text, cut up.
    if (!library.IsByte(library.PieceToId("<0x41>"))) {
      std::vector<std::string> pieces;
      REQUIRE(library.Encode(text, &pieces).ok());
      std::string joined;
      for (const auto& piece : pieces) joined += piece;
      ours->normalize(text, &normalized);
      CHECK(normalized == joined);
    }
  }
  return counts;
}

TEST_CASE("SentencePiece unigram tokenizer (NFKC, no byte fallback): our ids are the library's, unknown pieces merged") {
  const std::string model = train("nfkc", "--model_type=unigram");
  const Counts c = compare(model, 4000);
  CHECK(c.texts > 4000);
  CHECK(c.ids > 50000);
  CHECK(c.unknown > 1000);  // unknown characters, merged where they run on
  // NFKC reached: fullwidth letters, an ideographic space, a ligature, a tab; spaces collapsed.
  const auto ours = SentencePieceEncoder::from_model(read_bytes(model), nullptr);
  std::string normalized;
  ours->normalize("  \xef\xbd\x88\xef\xbd\x85\xe3\x80\x80\xef\xac\x81\tx  ", &normalized);
  CHECK(normalized == "\xe2\x96\x81he\xe2\x96\x81" "fi\xe2\x96\x81x");
}

TEST_CASE("SentencePiece unigram tokenizer with byte fallback: our ids are the library's, unknown characters as bytes") {
  const Counts c = compare(train("bytes", "--model_type=unigram --byte_fallback=true --character_coverage=0.9995"), 4000);
  CHECK(c.bytes > 1000);
  CHECK(c.unknown == 0);
}

TEST_CASE("SentencePiece unigram tokenizer with user-defined symbols: our ids are the library's") {
  // Symbols the normaliser must pass whole (one NFKC would change: a fullwidth 'Ａ'), one
  // that is a prefix of another, and one with a space.
  const std::vector<std::string> symbols = {"<tag>", "<tag>x", "mpipe", "\xef\xbc\xa1z", "a b", "\xe2\x96\x81the"};
  std::string list;
  for (const auto& symbol : symbols) list += (list.empty() ? "" : ",") + symbol;
  const Counts c = compare(train("user", "--model_type=unigram --user_defined_symbols='" + list + "'"), 3000, symbols);
  CHECK(c.user_defined > 500);
  CHECK(c.unknown > 500);
}

TEST_CASE("SentencePiece unigram tokenizer, Llama's settings (identity, spaces kept, byte fallback), no dummy prefix, whitespace as suffix") {
  const Counts llama = compare(train("identity", "--model_type=unigram --normalization_rule_name=identity"
                                                 " --remove_extra_whitespaces=false --byte_fallback=true"),
                               3000);
  CHECK(llama.bytes > 1000);
  const Counts plain = compare(train("noprefix", "--model_type=unigram --add_dummy_prefix=false"), 2000);
  CHECK(plain.unknown > 500);
  const Counts suffix = compare(train("suffix", "--model_type=unigram --treat_whitespace_as_suffix=true"), 2000);
  CHECK(suffix.unknown > 500);
}

// A ModelProto written here, field by field (sentencepiece_model.proto): what spm_train
// never writes. `pieces`: (text, score, type).
std::string varint(std::uint64_t v) {
  std::string out;
  for (; v >= 0x80; v >>= 7) out += static_cast<char>((v & 0x7f) | 0x80);
  return out + static_cast<char>(v);
}
std::string field_bytes(int field, const std::string& bytes) {
  return varint(static_cast<std::uint64_t>(field) << 3 | 2) + varint(bytes.size()) + bytes;
}
std::string field_float(int field, float f) {
  std::string out = varint(static_cast<std::uint64_t>(field) << 3 | 5) + std::string(4, '\0');
  std::memcpy(out.data() + out.size() - 4, &f, 4);
  return out;
}
struct SyntheticPiece {
  std::string text;
  float score;
  int type;
};
std::string synthetic_model(const std::vector<SyntheticPiece>& pieces, int model_type = 1, bool whitespace_as_suffix = false) {
  std::string model;
  for (const auto& p : pieces)
    model += field_bytes(1, field_bytes(1, p.text) + field_float(2, p.score) + varint(3 << 3) + varint(p.type));
  model += field_bytes(2, varint(3 << 3) + varint(static_cast<std::uint64_t>(model_type)) +  // 1 UNIGRAM, 2 BPE
                              (whitespace_as_suffix ? varint(24 << 3) + varint(1) : std::string()));
  // normalizer_spec: no charsmap (identity), dummy prefix, extra whitespace kept.
  model += field_bytes(3, field_bytes(1, "identity") + varint(3 << 3) + varint(1) + varint(4 << 3) + varint(0));
  return model;
}

// Pieces cut from the docs' text (spaces as U+2581), scores from a few values so that
// paths and merges tie, every 7th piece UNUSED (the unigram trie holds them and its Viterbi
// skips them; BPE merges into them and splits them back), every 97th USER_DEFINED.
std::vector<SyntheticPiece> synthetic_pieces(std::mt19937& rng, std::size_t count) {
  const std::string docs = docs_text();
  std::vector<SyntheticPiece> pieces = {{"<unk>", 0, 2}, {"<s>", 0, 3}, {"</s>", 0, 3}};
  std::set<std::string> seen = {"<unk>", "<s>", "</s>"};
  while (pieces.size() < count) {
    std::string text = docs.substr(rng() % docs.size(), 1 + rng() % 10), escaped;
    for (const char c : text) escaped += c == ' ' ? std::string("\xe2\x96\x81") : std::string(1, c);
    bool whole = true;  // whole UTF-8 characters only, as spm_train's pieces are
    for (std::size_t i = 0; whole && i < escaped.size();) {
      const auto lead = static_cast<unsigned char>(escaped[i]);
      const std::size_t len = lead < 0x80 ? 1 : lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : lead >= 0xc0 ? 2 : 0;
      whole = len > 0 && i + len <= escaped.size();
      for (std::size_t k = 1; whole && k < len; ++k) whole = (static_cast<unsigned char>(escaped[i + k]) & 0xc0) == 0x80;
      i += len;
    }
    if (!whole || escaped.empty()) continue;
    if (escaped.find('\0') != std::string::npos || !seen.insert(escaped).second) continue;
    const int type = pieces.size() % 97 == 0 ? 4 : pieces.size() % 7 == 0 ? 5 : 1;
    pieces.push_back({escaped, -0.5f * static_cast<float>(1 + rng() % 16), type});
  }
  return pieces;
}

// Our ids against the library's on `model` for `count` random strings; the ids compared.
std::size_t compare_synthetic(const std::string& model, std::mt19937& rng, int count) {
  sentencepiece::SentencePieceProcessor library;
  REQUIRE(library.LoadFromSerializedProto(model).ok());
  const auto ours = SentencePieceEncoder::from_model(model, nullptr);
  REQUIRE(ours != nullptr);
  const std::string docs = docs_text();
  std::size_t ids = 0;
  std::vector<std::int32_t> got;
  for (int i = 0; i < count; ++i) {
    const std::string text = random_text(rng, docs, {});
    std::vector<int> want;
    REQUIRE(library.Encode(text, &want).ok());
    got.clear();
    CHECK(ours->encode(text, &got));
    CHECK(std::vector<int>(got.begin(), got.end()) == want);
    ids += want.size();
  }
  return ids;
}

TEST_CASE("SentencePiece unigram tokenizer on a model written here: 60000 pieces, UNUSED ones, ties, no charsmap") {
  std::mt19937 rng(7);
  CHECK(compare_synthetic(synthetic_model(synthetic_pieces(rng, 60000)), rng, 1500) > 10000);
}

TEST_CASE("SentencePiece BPE tokenizer: our ids are the library's (NFKC; Llama's settings; user-defined symbols)") {
  const Counts nfkc = compare(train("bpe", "--model_type=bpe"), 3000);
  CHECK(nfkc.unknown > 500);
  const Counts llama = compare(train("bpe-llama", "--model_type=bpe --byte_fallback=true --normalization_rule_name=identity"
                                                  " --remove_extra_whitespaces=false --split_digits=true"),
                               3000);
  CHECK(llama.bytes > 1000);
  const std::vector<std::string> symbols = {"<tag>", "<tag>x", "mpipe", "\xef\xbc\xa1z", "\xe2\x96\x81the"};
  std::string list;
  for (const auto& symbol : symbols) list += (list.empty() ? "" : ",") + symbol;
  const Counts user = compare(train("bpe-user", "--model_type=bpe --user_defined_symbols='" + list + "'"), 3000, symbols);
  CHECK(user.user_defined > 500);
}

// Texts of words drawn from a few dozen (most words repeat, so a word's kept ids serve
// again, within a text and across texts), between runs of spaces, tabs, newlines and
// unknown characters, and words of unknown characters, U+2581 itself, user-defined symbols.
std::vector<std::string> word_texts(std::mt19937& rng, int count) {
  static const std::vector<std::string> words = {
      "the", "pipeline", "stage", "stages", "s", "x", "mpipe's", "1000", "\xe4\xb8\xad", "\xe4\xb8\xad\xe6\x96\x87",
      "\xf0\x9f\x98\x80", "a\xe4\xb8\xad", "\xe4\xb8\xad" "b", "\x01", "\xc3\xa9t\xc3\xa9", "\xef\xbd\x88", "\xe2\x96\x81",
      "\xe2\x96\x81\xe2\x96\x81x", "<tag>", "<tag>x", "mpipe", "\xe2\x96\x81the", "\xff", "e\xcc\x81", "tensor", "rank",
      "of", "and", "\xef\xbf\xbd", "(the)", "the,", "\xe2\x80\x94"};
  static const std::vector<std::string> gaps = {" ", " ", " ", " ", "  ", "   ", "\t", "", "\n", " \xe4\xb8\xad ",
                                                "\xe3\x80\x80", " \xe2\x96\x81 ", "\xe4\xb8\xad ", " \xf0\x9f\x98\x80"};
  std::vector<std::string> texts;
  for (int i = 0; i < count; ++i) {
    std::string text = rng() % 3 == 0 ? gaps[rng() % gaps.size()] : "";
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) text += words[rng() % words.size()] + gaps[rng() % gaps.size()];
    texts.push_back(text);
  }
  return texts;
}

// Our ids against the library's on `texts`, twice (the second time from kept words), each
// text also encoded by `other` in between (another encoder on the same thread); the ids.
std::size_t compare_texts(const std::string& model, const std::vector<std::string>& texts,
                          const SentencePieceEncoder* other = nullptr) {
  sentencepiece::SentencePieceProcessor library;
  REQUIRE(library.LoadFromSerializedProto(model).ok());
  const auto ours = SentencePieceEncoder::from_model(model, nullptr);
  REQUIRE(ours != nullptr);
  std::size_t ids = 0, wrong = 0;
  std::vector<std::int32_t> got, scratch;
  for (int pass = 0; pass < 2; ++pass)
    for (const std::string& text : texts) {
      std::vector<int> want;
      REQUIRE(library.Encode(text, &want).ok());
      got.clear();
      CHECK(ours->encode(text, &got));
      wrong += std::vector<int>(got.begin(), got.end()) != want;
      if (other) other->encode(text, &scratch);
      ids += want.size();
    }
  CHECK(wrong == 0);
  return ids;
}

TEST_CASE("SentencePiece BPE by words: trained models' ids are the library's on texts of repeated words") {
  std::mt19937 rng(9);
  const std::vector<std::string> texts = word_texts(rng, 1500);
  const auto other = SentencePieceEncoder::from_model(read_bytes(train("bpe-llama", "--model_type=bpe --byte_fallback=true"
      " --normalization_rule_name=identity --remove_extra_whitespaces=false --split_digits=true")), nullptr);
  REQUIRE(other != nullptr);
  CHECK(other->bpe_by_words());
  for (const std::string options : {"--model_type=bpe", "--model_type=bpe --add_dummy_prefix=false",
                                    "--model_type=bpe --treat_whitespace_as_suffix=true",
                                    "--model_type=bpe --byte_fallback=true --normalization_rule_name=identity"
                                    " --remove_extra_whitespaces=false --split_digits=true",
                                    "--model_type=bpe --remove_extra_whitespaces=false --allow_whitespace_only_pieces=true",
                                    "--model_type=bpe --user_defined_symbols='<tag>,<tag>x,mpipe,\xe2\x96\x81the'"}) {
    CAPTURE(options);
    const std::string model = read_bytes(train("bpe-words" + std::to_string(std::hash<std::string>()(options)), options));
    const auto ours = SentencePieceEncoder::from_model(model, nullptr);
    REQUIRE(ours != nullptr);
    CHECK(ours->bpe_by_words());
    // Another model's encoder on the same thread between texts: each keeps its own words.
    CHECK(compare_texts(model, texts, other.get()) > 50000);
  }
}

// Synthetic pieces (tied scores) whose U+2581 are a run at the start (at the end: suffix),
// without UNUSED ones and without "\u2581" alone, so that U+2581 between unknown
// characters is unknown too and the library's run of unknown pieces spans words.
std::vector<SyntheticPiece> word_pieces(std::mt19937& rng, bool suffix) {
  std::vector<SyntheticPiece> pieces;
  for (SyntheticPiece p : synthetic_pieces(rng, 20000)) {
    std::string core = p.text;
    const std::string space = "\xe2\x96\x81";
    if (!suffix)
      while (core.compare(0, 3, space) == 0) core.erase(0, 3);
    else
      while (core.size() >= 3 && core.compare(core.size() - 3, 3, space) == 0) core.erase(core.size() - 3);
    if (core.find(space) != std::string::npos || p.text == space) continue;
    if (p.type == 5) p.type = 1;
    pieces.push_back(p);
  }
  return pieces;
}

TEST_CASE("SentencePiece BPE by words: models written here (ties, unknown runs across words, spaces as suffix)") {
  std::mt19937 rng(10);
  for (const bool suffix : {false, true}) {
    CAPTURE(suffix);
    const std::string model = synthetic_model(word_pieces(rng, suffix), 2, suffix);
    const auto ours = SentencePieceEncoder::from_model(model, nullptr);
    REQUIRE(ours != nullptr);
    CHECK(ours->bpe_by_words());
    CHECK(compare_texts(model, word_texts(rng, 1500)) > 50000);
    CHECK(compare_synthetic(model, rng, 1500) > 10000);
    // "中 文": U+2581 is unknown here, so the library gives one unknown piece for the two words.
    sentencepiece::SentencePieceProcessor library;
    REQUIRE(library.LoadFromSerializedProto(model).ok());
    std::vector<int> want;
    REQUIRE(library.Encode("\xe4\xb8\xad \xe6\x96\x87", &want).ok());
    CHECK(want == std::vector<int>{0});
  }
}

TEST_CASE("SentencePiece BPE by words: pieces with U+2581 after other characters join the words they span") {
  // Merges may cross words ("a\u2581b" pieces): where such a piece is spelt across a word's
  // end in the text, the words on both sides are merged as one (Llama 2's trainer settings
  // allow such pieces).
  std::mt19937 rng(11);
  std::vector<SyntheticPiece> pieces = synthetic_pieces(rng, 20000);
  std::size_t crossing = 0;
  for (SyntheticPiece& p : pieces) {
    if (p.type == 5) p.type = 1;
    std::size_t lead = 0;
    while (p.text.compare(lead, 3, "\xe2\x96\x81") == 0) lead += 3;
    crossing += p.text.find("\xe2\x96\x81", lead) != std::string::npos;
  }
  CHECK(crossing > 1000);
  const std::string model = synthetic_model(pieces, 2);
  const auto ours = SentencePieceEncoder::from_model(model, nullptr);
  REQUIRE(ours != nullptr);
  CHECK(ours->bpe_by_words());
  CHECK(compare_texts(model, word_texts(rng, 1000)) > 30000);
  // The encoder keeps what it needs of the file: the same ids once the file's bytes are gone.
  std::string copy = model;
  const auto kept = SentencePieceEncoder::from_model(copy, nullptr);
  std::fill(copy.begin(), copy.end(), 'x');
  std::size_t differ = 0;
  std::vector<std::int32_t> a, b;
  for (const std::string& text : word_texts(rng, 300)) {
    a.clear(), b.clear();
    CHECK(ours->encode(text, &a));
    CHECK(kept->encode(text, &b));
    differ += a != b;
  }
  CHECK(differ == 0);
  CHECK(compare_synthetic(model, rng, 1500) > 10000);
}

TEST_CASE("SentencePiece BPE tokenizer on a model written here: 30000 pieces, UNUSED ones split back, tied scores") {
  std::mt19937 rng(8);
  const std::string model = synthetic_model(synthetic_pieces(rng, 30000), 2);
  CHECK_FALSE(SentencePieceEncoder::from_model(model, nullptr)->bpe_by_words());  // the whole text's merges
  CHECK(compare_synthetic(model, rng, 1500) > 10000);
  CHECK(compare_texts(model, word_texts(rng, 500)) > 10000);
}

TEST_CASE("SentencePiece BPE tokenizer: a control piece the text spells leaves the text to the library") {
  // The library's Encode fails on such a text (its pieces do not cover the text); mpipe's
  // encoder says so rather than give ids, and the tokenizer asks the library.
  const std::string model = train("bpe-control", "--model_type=bpe --control_symbols='\xc2\xa7'");
  const auto ours = SentencePieceEncoder::from_model(read_bytes(model), nullptr);
  REQUIRE(ours != nullptr);
  std::vector<std::int32_t> ids;
  CHECK(ours->encode("a b", &ids));
  CHECK_FALSE(ours->encode("a \xc2\xa7 b", &ids));
  sentencepiece::SentencePieceProcessor library;
  REQUIRE(library.Load(model).ok());
  std::vector<int> want;
  CHECK_FALSE(library.Encode("a \xc2\xa7 b", &want).ok());
  CHECK_THROWS(load_tokenizer(model)->encode("a \xc2\xa7 b"));
}

TEST_CASE("SentencePiece tokenizers: unigram and BPE models take mpipe's encoder, char models the library's") {
  const std::string unigram = train("nfkc", "--model_type=unigram"), bpe = train("bpe", "--model_type=bpe");
  const std::string chars = train("char", "--model_type=char");
  CHECK(load_tokenizer(unigram)->describe().find("unigram, mpipe's encoder") != std::string::npos);
  CHECK(load_tokenizer(bpe)->describe().find("BPE, mpipe's encoder") != std::string::npos);
  std::string why;
  CHECK(SentencePieceEncoder::from_model(read_bytes(chars), &why) == nullptr);
  CHECK(why == "neither a unigram nor a BPE model");
  const auto char_tok = load_tokenizer(chars);
  CHECK(char_tok->describe().find("libsentencepiece's encoder: neither a unigram nor a BPE model") != std::string::npos);
  const std::string text = docs_text();
  for (const std::string& model : {unigram, bpe, chars}) {
    sentencepiece::SentencePieceProcessor library;
    REQUIRE(library.Load(model).ok());
    std::vector<int> want;
    REQUIRE(library.Encode(text, &want).ok());
    const std::vector<std::int32_t> got = load_tokenizer(model)->encode(text);
    CHECK(std::vector<int>(got.begin(), got.end()) == want);
  }
  // MPIPE_SENTENCEPIECE=library: the library's encoder (the bench's baseline), the same ids.
  ::setenv("MPIPE_SENTENCEPIECE", "library", 1);
  const auto library_tok = load_tokenizer(unigram);
  ::unsetenv("MPIPE_SENTENCEPIECE");
  CHECK(library_tok->describe().find("libsentencepiece's encoder: MPIPE_SENTENCEPIECE=library") != std::string::npos);
  CHECK(library_tok->encode(text) == load_tokenizer(unigram)->encode(text));
  // Files that are not models are refused as before (the library decides).
  CHECK(SentencePieceEncoder::from_model("not a model", &why) == nullptr);
  CHECK(SentencePieceEncoder::from_model("", &why) == nullptr);
}

}  // namespace
}  // namespace mpipe
