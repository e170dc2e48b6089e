// Writing TOML values as text: options files (app/config_file) and model files
// (nn/registry) both write what a TOML parser reads back as the same value.
#pragma once
#include <charconv>
#include <string>

namespace mpipe {

// The shortest text that reads back as the same value (0.001f, not 0.00100000005).
template <class T>
std::string shortest_text(T x) {
  char text[32];
  const auto r = std::to_chars(text, text + sizeof text, x);
  return std::string(text, r.ptr);
}

// A float as TOML writes it: the shortest round-trip text, with a point (1.0, not 1).
template <class T>
std::string toml_float(T x) {
  std::string text = shortest_text(x);
  if (text.find_first_of(".en") == std::string::npos) text += ".0";
  return text;
}

// A TOML basic string.
inline std::string toml_quoted(const std::string& text) {
  std::string out = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

// A parser's message as one printable line (it may quote the bytes it choked on).
inline std::string printable_line(std::string text) {
  for (char& ch : text)
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f) ch = '?';
  return text;
}

}  // namespace mpipe
