// Errors: one family of checks that throw with context, and the user/internal split.
//
// UserError is for things the user can fix (config, data file, sizes): main reports it
// as one line with a hint and exits with code 2. Error is for broken invariants: it
// carries file:line and the failing expression. Both are caught once, in main.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mpipe {

template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

// "a, b or c": the choices an error's hint offers.
inline std::string either(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) out += cat(i == 0 ? "" : i + 1 == names.size() ? " or " : ", ", names[i]);
  return out;
}

// An internal error: a bug or a broken invariant.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait that passed its deadline (--p2p-timeout): another rank may have stopped.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A problem with the user's input; `hint` says what to do about it.
class UserError : public std::runtime_error {
 public:
  // Control bytes and bytes that are not UTF-8 (a binary file's, quoted back) become '?':
  // the error stays one line a terminal prints as it is; UTF-8 text (a path in another
  // script) is kept.
  UserError(std::string what, std::string hint)
      : std::runtime_error(one_line(what)), hint_(one_line(hint)) {}
  const std::string& hint() const { return hint_; }

 private:
  static std::string one_line(const std::string& text) {
    std::string out;
    out.reserve(text.size());
    for (std::size_t i = 0; i < text.size();) {
      const auto byte = [&](std::size_t at) { return static_cast<unsigned char>(text[at]); };
      const unsigned char lead = byte(i);
      // The continuation bytes a lead byte announces (0: ASCII; -1: not a lead byte).
      const int more = lead < 0x80 ? 0 : lead >= 0xc2 && lead <= 0xdf ? 1 : lead >= 0xe0 && lead <= 0xef ? 2
                     : lead >= 0xf0 && lead <= 0xf4 ? 3 : -1;
      bool whole = more >= 0 && i + static_cast<std::size_t>(more) < text.size();
      for (int k = 1; whole && k <= more; ++k) whole = (byte(i + static_cast<std::size_t>(k)) & 0xc0) == 0x80;
      if (!whole || lead < 0x20 || lead == 0x7f) {
        out += '?';
        ++i;
        continue;
      }
      out.append(text, i, static_cast<std::size_t>(more) + 1);
      i += static_cast<std::size_t>(more) + 1;
    }
    return out;
  }
  std::string hint_;
};

// Throws `e`'s kind (a timeout stays a timeout, a user's error keeps its hint) with a
// message that gives more context.
[[noreturn]] inline void rethrow_as(const std::exception& e, const std::string& message) {
  if (dynamic_cast<const TimeoutError*>(&e)) throw TimeoutError(message);
  if (const auto* user = dynamic_cast<const UserError*>(&e)) throw UserError(message, user->hint());
  throw Error(message);
}

[[noreturn]] void throw_check_failure(const char* file, int line, const char* expr,
                                      const std::string& message);

}  // namespace mpipe

// MPIPE_CHECK(cond, parts...): throws mpipe::Error "file:line: check `cond` failed: parts".
#define MPIPE_CHECK(cond, ...)                                                         \
  do {                                                                                 \
    if (!(cond)) [[unlikely]]                                                          \
      ::mpipe::throw_check_failure(__FILE__, __LINE__, #cond, ::mpipe::cat(__VA_ARGS__)); \
  } while (0)

// MPIPE_REQUIRE(cond, hint, parts...): throws mpipe::UserError when cond is false.
#define MPIPE_REQUIRE(cond, hint, ...)                                   \
  do {                                                                   \
    if (!(cond)) [[unlikely]]                                            \
      throw ::mpipe::UserError(::mpipe::cat(__VA_ARGS__), (hint));       \
  } while (0)
