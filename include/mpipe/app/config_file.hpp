// Options files (`--config FILE`): TOML, read into a command's options and written from
// a TrainConfig (the checkpoint's `config` attribute, `mpipe inspect --config`).
#pragma once
#include <string>

#include <CLI/CLI.hpp>

#include "mpipe/core/toml_text.hpp"
#include "mpipe/app/config.hpp"

namespace mpipe {

// Applies the command's --config TOML file, if given, under the command-line values.
// UserError naming the file, line and column for broken TOML, an unknown key, a value
// of the wrong type; files that are not regular files are never opened.
void apply_config_file(CLI::App& command);

// Every option that shapes a run (not where its outputs go, nor per-invocation choices
// such as --resume or --progress), as TOML that `train --config` reads: `mpipe inspect
// CKPT --config > run.toml` and `mpipe train --config run.toml` continue the run.
std::string to_toml(const TrainConfig& config);

}  // namespace mpipe
