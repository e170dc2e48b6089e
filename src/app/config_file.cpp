// `--config FILE`: a TOML file of options, read with a real TOML parser (toml++,
// header-only here) so that a broken file is one clear line naming where it breaks.
#include <charconv>
#include <filesystem>
#include <string>

#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 1
#include <toml++/toml.h>

#include "mpipe/app/commands.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe {

namespace {

std::string where(const std::string& path, const toml::source_region& at) {
  return cat("config file '", path, "' line ", at.begin.line, ", column ", at.begin.column);
}

// A TOML value as the text CLI11 converts, or nothing for what no option takes.
std::optional<std::string> as_text(const toml::node& value) {
  if (const auto* s = value.as_string()) return s->get();
  if (const auto* i = value.as_integer()) return std::to_string(i->get());
  if (const auto* b = value.as_boolean()) return std::string(b->get() ? "true" : "false");
  if (const auto* f = value.as_floating_point()) {
    char text[32];
    const auto r = std::to_chars(text, text + sizeof text, f->get());
    return std::string(text, r.ptr);
  }
  return std::nullopt;
}

}  // namespace

void apply_config_file(CLI::App& command) {
  const CLI::Option* config = command.get_option("--config");
  if (config->count() == 0) return;
  const std::string path = config->as<std::string>();
  namespace fs = std::filesystem;
  std::error_code ec;
  // Never open what could block (a FIFO with no writer) or what is no file at all.
  MPIPE_REQUIRE(fs::exists(path, ec), "give the path of a TOML file", "config file '", path, "' does not exist");
  MPIPE_REQUIRE(fs::is_regular_file(path, ec), "give the path of a TOML file",
                "config file '", path, "' is not a regular file");
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::string what(e.description());
    for (char& ch : what)  // one line, printable: the parser may quote what it choked on
      if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f) ch = '?';
    throw UserError(cat(where(path, e.source()), ": ", what), "check the TOML syntax (key = value, one per line)");
  }
  for (const auto& [key, value] : table) {
    const std::string name(key.str());
    const std::string at = where(path, key.source());
    MPIPE_REQUIRE(!value.is_table() && !value.is_array_of_tables(), "put every option at the top level of the file",
                  at, ": sections are not supported ([", name, "])");
    CLI::Option* option = command.get_option_no_throw("--" + name);
    MPIPE_REQUIRE(option && name != "config", cat("see 'mpipe ", command.get_name(), " --help' for the names"), at,
                  ": unknown option '", name, "'");
    const std::optional<std::string> text = as_text(value);
    MPIPE_REQUIRE(text.has_value(), "give a string, a number or true/false", at, ": ", name,
                  ": lists, dates and times are not option values");
    if (option->count() > 0) continue;  // the command line wins
    option->add_result(*text);
    try {
      option->run_callback();
    } catch (const CLI::ParseError& e) {
      throw UserError(cat(at, ": ", name, ": ", e.what()), "check the value's type");
    }
  }
}

}  // namespace mpipe
