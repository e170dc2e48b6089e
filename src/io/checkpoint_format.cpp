// The checkpoint format: names, HDF5 attributes and checksums, the training state, the
// model's signature and verification; no MPI.
#include "mpipe/io/checkpoint_format.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "mpipe/core/version.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {

// Where two layer lists (model files) first differ: "layer 4 (linear): out = 64 there,
// out = 48 here", or "" when they do not.
std::string first_difference(const std::string& there, const std::string& here) {
  std::istringstream a(there), b(here);
  std::string x, y, kind, inner_kind;
  int layer = -1, inner = -1;  // inner: a residual block's layer ([[layer.layer]])
  for (;;) {
    const bool more_a = static_cast<bool>(std::getline(a, x)), more_b = static_cast<bool>(std::getline(b, y));
    if (!more_a && !more_b) return "";
    if (!more_a || !more_b) return more_a ? cat("it has more layers, from layer ", layer + 1) : cat("it has fewer layers: ", layer + 1);
    if (x == "[[layer]]") ++layer, inner = -1;
    if (x == "[[layer.layer]]") ++inner;
    if (x.rfind("kind = ", 0) == 0) (inner < 0 ? kind : inner_kind) = x.substr(8, x.size() - 9);
    if (x != y) {
      if (layer < 0) return cat(x, " there, ", y, " here");
      return cat("layer ", layer, " (", kind, ")", inner >= 0 ? cat(", inner layer ", inner, " (", inner_kind, ")") : "", ": ",
                 x.empty() ? "(nothing)" : x, " there, ", y.empty() ? "(nothing)" : y, " here");
    }
  }
}

// The text the training state's CRC-32 covers.

std::string state_text(const TrainState& s) {
  return cat("step=", s.step, "\nupdates=", s.updates, "\nsamples=", s.samples, "\nposition=", s.position,
             "\nseed=", s.seed, "\ndata=", s.data, "\nrun=", s.run_id, "\nsignature=", s.signature,
             "\noptimizer=", s.optimizer, "\nconfig=", s.config);
}

}  // namespace

std::string model_text(const Model& model) {
  ModelSpec spec = model.spec();
  spec.name.clear();
  const std::string text = spec.to_toml();
  return text.substr(text.find('\n') + 1);
}



std::uint32_t crc32_of(const void* data, std::size_t bytes) {
  return static_cast<std::uint32_t>(crc32_z(0L, static_cast<const Bytef*>(data), bytes));
}

std::string layer_key(int layer) {
  char text[16];
  std::snprintf(text, sizeof text, "%04d", layer);
  return text;
}


std::vector<DatasetSpec> parameter_datasets(const Model& model, const std::string& root) {
  std::vector<DatasetSpec> out;
  for (int layer = 0; layer < model.size(); ++layer)
    for (const ParamSpec& spec : model.layer(layer).param_specs())
      if (spec.tied_layer < 0) out.push_back({root + "/" + layer_key(layer) + "/" + spec.name, spec.shape, layer, spec.name});
  return out;
}

std::vector<hsize_t> dims(const Shape& s) {
  std::vector<hsize_t> d;
  for (int i = 0; i < s.rank; ++i) d.push_back(static_cast<hsize_t>(s[i]));
  return d;
}

void write_string_attribute(hid_t object, const char* name, const std::string& value) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<std::size_t>(1, value.size()));
  H5Tset_strpad(type.get(), H5T_STR_NULLTERM);
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  H5_CHECK(attr.get(), "cannot create attribute ", name);
  H5_CHECK(H5Awrite(attr.get(), type.get(), value.c_str()), "cannot write attribute ", name);
}


std::optional<std::string> read_string_attribute(hid_t object, const char* name) {
  if (H5Aexists(object, name) <= 0) return std::nullopt;
  Handle attr(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) > 0) return std::nullopt;
  std::string value(H5Tget_size(type.get()), '\0');
  Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mem.get(), value.size());
  if (H5Aread(attr.get(), mem.get(), value.data()) < 0) return std::nullopt;
  value.resize(std::strlen(value.c_str()));
  return value;
}


std::optional<std::string> read_checked(hid_t file, const std::string& path, float* out, std::size_t count) {
  if (H5Lexists(file, path.c_str(), H5P_DEFAULT) <= 0) return cat("dataset ", path, " is missing");
  Handle set(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose);
  if (!set.ok()) return cat("dataset ", path, " cannot be opened");
  Handle space(H5Dget_space(set.get()), H5Sclose);
  if (static_cast<std::size_t>(H5Sget_simple_extent_npoints(space.get())) != count)
    return cat("dataset ", path, " has ", H5Sget_simple_extent_npoints(space.get()), " elements, expected ", count);
  if (H5Dread(set.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0)
    return cat("dataset ", path, " cannot be read (truncated file?)");
  const auto stored = read_scalar_attribute<uint32_t>(set.get(), "crc32", H5T_NATIVE_UINT32);
  if (!stored) return cat("dataset ", path, " has no checksum");
  if (*stored != crc32_of(out, count * sizeof(float))) return cat("dataset ", path, " fails its checksum (altered or damaged)");
  return std::nullopt;
}

void write_train_state(hid_t file, const TrainState& state, const Model& model) {
  const std::string text = state_text(state);
  Handle train(H5Gcreate2(file, "/train", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  H5_CHECK(train.get(), "cannot create /train");
  write_scalar_attribute<std::int64_t>(train.get(), "step", H5T_STD_I64LE, state.step);
  write_scalar_attribute<std::int64_t>(train.get(), "optimizer_updates", H5T_STD_I64LE, state.updates);
  write_scalar_attribute<std::int64_t>(train.get(), "samples_consumed", H5T_STD_I64LE, state.samples);
  write_scalar_attribute<std::int64_t>(train.get(), "data_position", H5T_STD_I64LE, state.position);
  write_scalar_attribute<std::uint64_t>(train.get(), "seed", H5T_STD_U64LE, state.seed);
  write_string_attribute(train.get(), "data", state.data);
  write_string_attribute(train.get(), "run_id", state.run_id);
  write_scalar_attribute<std::uint32_t>(train.get(), "crc32", H5T_STD_U32LE, crc32_of(text.data(), text.size()));
  write_string_attribute(file, "format", checkpoint_format);
  write_scalar_attribute<int>(file, "format_version", H5T_STD_I32LE, checkpoint_format_version);
  write_string_attribute(file, "mpipe_version", cat(version(), " (git ", git_hash(), ")"));
  write_string_attribute(file, "model_signature", state.signature);
  write_string_attribute(file, "optimizer", state.optimizer);
  write_string_attribute(file, "config", state.config);
  write_string_attribute(file, "model", model_text(model));  // its layer list, as a model file
}

std::optional<std::string> read_train_state(hid_t file, const std::string& path, TrainState& s) {
  s.version = read_scalar_attribute<int>(file, "format_version", H5T_NATIVE_INT).value_or(-1);
  if (s.version < checkpoint_oldest_readable_version || s.version > checkpoint_format_version)
    return cat("'", path, "' has checkpoint format version ", s.version, "; this mpipe reads versions ",
               checkpoint_oldest_readable_version, " to ", checkpoint_format_version);
  if (H5Lexists(file, "/train", H5P_DEFAULT) <= 0) return cat("'", path, "' has no /train group");
  Handle train(H5Gopen2(file, "/train", H5P_DEFAULT), H5Gclose);
  if (!train.ok()) return cat("'", path, "' has no /train group");
  s.step = read_scalar_attribute<int64_t>(train.get(), "step", H5T_NATIVE_INT64).value_or(-1);
  s.updates = read_scalar_attribute<int64_t>(train.get(), "optimizer_updates", H5T_NATIVE_INT64).value_or(-1);
  s.samples = read_scalar_attribute<int64_t>(train.get(), "samples_consumed", H5T_NATIVE_INT64).value_or(-1);
  s.position = read_scalar_attribute<int64_t>(train.get(), "data_position", H5T_NATIVE_INT64).value_or(-1);
  s.seed = read_scalar_attribute<uint64_t>(train.get(), "seed", H5T_NATIVE_UINT64).value_or(0);
  s.data = read_string_attribute(train.get(), "data").value_or("");
  s.run_id = read_string_attribute(train.get(), "run_id").value_or("");
  s.signature = read_string_attribute(file, "model_signature").value_or("");
  s.optimizer = read_string_attribute(file, "optimizer").value_or("");
  s.config = read_string_attribute(file, "config").value_or("");
  if (s.step < 0 || s.updates < 0 || s.samples < 0 || s.position < 0)
    return cat("'", path, "' lacks its training state (/train step, optimizer_updates, samples_consumed, data_position)");
  if (s.version >= 2) {
    const auto stored = read_scalar_attribute<uint32_t>(train.get(), "crc32", H5T_NATIVE_UINT32);
    if (!stored) return cat("'", path, "': /train has no checksum");
    const std::string text = state_text(s);
    if (*stored != crc32_of(text.data(), text.size()))
      return cat("'", path, "': the training state (/train and the root attributes) fails its checksum (altered or damaged)");
    if (s.run_id.empty()) return cat("'", path, "': /train has no run id");
  }
  if (s.updates > s.step) return cat("'", path, "': /train says ", s.updates, " optimizer updates in ", s.step, " steps");
  if (s.samples != s.position)
    return cat("'", path, "': /train's samples_consumed ", s.samples, " and data_position ", s.position, " differ");
  if (const int64_t named = checkpoint_step_of_name(path); named >= 0 && named != s.step)
    return cat("'", path, "' is named for step ", named, " but holds step ", s.step);
  return std::nullopt;
}

std::string checkpoint_path(const std::string& dir, std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "ckpt-%08lld.h5", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

std::int64_t checkpoint_step_of_name(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  if (name.size() != 16 || name.rfind("ckpt-", 0) != 0 || name.substr(13) != ".h5") return -1;
  std::int64_t step = 0;
  for (char c : name.substr(5, 8)) {
    if (c < '0' || c > '9') return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

std::optional<std::string> checkpoint_run_id(const std::string& path) {
  quiet_hdf5();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec) || H5Fis_hdf5(path.c_str()) <= 0) return std::nullopt;
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok() || read_string_attribute(file.get(), "format") != checkpoint_format) return std::nullopt;
  TrainState state;
  if (read_train_state(file.get(), path, state)) return std::nullopt;
  return state.run_id;
}

std::string model_signature(const Model& model) {
  const ModelConfig& c = model.config();
  std::string s;
  if (c.kind == "gpt") {
    s = cat("gpt layers=", c.layers, " d_model=", c.d_model, " heads=", c.heads, " seq_len=", c.seq_len, " vocab=", c.vocab);
  } else if (c.kind == "mlp") {
    s = cat("mlp layers=", c.layers, " hidden=", c.hidden, " inputs=", c.inputs, " classes=", c.classes);
  } else if (c.kind == "resnet") {
    s = cat("resnet layers=", c.layers, " image=", c.image, " channels=", c.channels, " width=", c.width, " classes=", c.classes);
  } else {  // a model file: its layer list, wherever the file lies
    const std::string text = model_text(model);
    char list[16];
    std::snprintf(list, sizeof list, "%08x", static_cast<unsigned>(crc32_of(text.data(), text.size())));
    s = cat("file layers=", model.size(), " list=", list);
  }
  std::string layout;
  for (const DatasetSpec& d : parameter_datasets(model, "")) layout += d.path + d.shape.str() + ";";
  char hash[16];
  std::snprintf(hash, sizeof hash, "%08x", static_cast<unsigned>(crc32_of(layout.data(), layout.size())));
  return s + " layout=" + hash;
}

std::optional<std::string> verify_checkpoint(const std::string& path, const Model* model, bool read_data) {
  quiet_hdf5();
  if (!fs::is_regular_file(path)) return cat("no file '", path, "'");
  if (H5Fis_hdf5(path.c_str()) <= 0) return cat("'", path, "' is not an HDF5 file");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) return cat("'", path, "' cannot be opened as HDF5 (truncated or damaged)");
  const auto format = read_string_attribute(file.get(), "format");
  if (!format || *format != checkpoint_format) return cat("'", path, "' is not an mpipe checkpoint");
  TrainState state;
  if (auto bad = read_train_state(file.get(), path, state)) return bad;
  const std::string signature = model ? model_signature(*model) : std::string();
  if (model && state.signature != signature) {
    const auto list = read_string_attribute(file.get(), "model");
    const std::string difference = list ? first_difference(*list, model_text(*model)) : std::string();
    return cat("'", path, "' holds another model (", difference.empty() ? state.signature : difference, ")");
  }
  // Every float dataset against its checksum.
  struct Visit {
    hid_t file;
    std::optional<std::string> problem;
    std::size_t datasets = 0;
    std::vector<float> buffer;
    bool read_data;
  } visit{file.get(), std::nullopt, 0, {}, read_data};
  const herr_t rc = H5Ovisit2(
      file.get(), H5_INDEX_NAME, H5_ITER_NATIVE,
      [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
        auto* v = static_cast<Visit*>(data);
        if (info->type != H5O_TYPE_DATASET) return 0;
        Handle set(H5Dopen2(v->file, name, H5P_DEFAULT), H5Dclose);
        Handle space(H5Dget_space(set.get()), H5Sclose);
        const auto n = static_cast<std::size_t>(std::max<hssize_t>(0, H5Sget_simple_extent_npoints(space.get())));
        Handle type(H5Dget_type(set.get()), H5Tclose);
        if (H5Tget_class(type.get()) != H5T_FLOAT) return 0;  // /train scalars are checked when read
        if (!v->read_data) {  // structure only: the data was checked as it was written
          if (H5Aexists(set.get(), "crc32") <= 0) {
            v->problem = cat("dataset /", name, " has no checksum");
            return 1;
          }
          ++v->datasets;
          return 0;
        }
        v->buffer.resize(n);
        if (auto p = read_checked(v->file, std::string("/") + name, v->buffer.data(), n)) {
          v->problem = *p;
          return 1;
        }
        ++v->datasets;
        return 0;
      },
      &visit, H5O_INFO_BASIC);
  if (visit.problem) return cat("'", path, "': ", *visit.problem);
  if (rc < 0) return cat("'", path, "' cannot be walked (damaged)");
  if (visit.datasets == 0) return cat("'", path, "' holds no parameters");
  return std::nullopt;
}

}  // namespace mpipe
