// The checkpoint format: names, HDF5 attributes and checksums, the training state, the
// model's signature and verification; no MPI.
#include "mpipe/io/checkpoint_format.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "mpipe/core/file_kind.hpp"
#include "mpipe/core/version.hpp"
#include "mpipe/core/toml_text.hpp"
#include "mpipe/io/checkpoint_tokenizer.hpp"
#include "mpipe/nn/optimizer.hpp"

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



std::string disk_reason(int error) {
  switch (error) {
    case ENOSPC: case EDQUOT: case EIO: case EROFS: case EFBIG: return cat(": ", std::strerror(error));
    default: return "";
  }
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


namespace {

// Each link on `path` ("/a/b/c": /a, /a/b, /a/b/c) a hard one, and present.
std::optional<std::string> hard_links_only(hid_t file, const std::string& path, const char* what) {
  for (std::size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string prefix = path.substr(0, end);
    const bool last = end == std::string::npos;
    const char* kind = last ? what : "group";
    if (H5Lexists(file, prefix.c_str(), H5P_DEFAULT) <= 0) return cat(kind, " ", prefix, " is missing");
    H5L_info_t link{};
    if (H5Lget_info(file, prefix.c_str(), &link, H5P_DEFAULT) < 0) return cat(kind, " ", prefix, " cannot be read");
    if (link.type != H5L_TYPE_HARD)
      return cat(kind, " ", prefix, " is ",
                 link.type == H5L_TYPE_SOFT ? "a soft" : link.type == H5L_TYPE_EXTERNAL ? "an external" : "a user-defined",
                 " link, not data of its own");
    if (last) return std::nullopt;
  }
}

std::string shape_text(const hsize_t* d, int rank) {
  if (rank == 0) return "a scalar";
  std::string s = "(";
  for (int i = 0; i < rank; ++i) s += cat(i ? ", " : "", d[i]);
  return s + ")";
}

}  // namespace

std::optional<std::string> check_dataset(hid_t file, const std::string& path, const Shape& shape) {
  if (auto bad = hard_links_only(file, path, "dataset")) return bad;
  H5O_info_t object{};
  if (H5Oget_info_by_name2(file, path.c_str(), &object, H5O_INFO_BASIC, H5P_DEFAULT) < 0 || object.type != H5O_TYPE_DATASET)
    return cat(path, " is not a dataset");
  Handle set(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose);
  if (!set.ok()) return cat("dataset ", path, " cannot be opened");
  Handle type(H5Dget_type(set.get()), H5Tclose);
  if (!type.ok() || H5Tequal(type.get(), H5T_IEEE_F32LE) <= 0) return cat("dataset ", path, " is not float32 (IEEE, little-endian)");
  Handle space(H5Dget_space(set.get()), H5Sclose);
  hsize_t d[H5S_MAX_RANK] = {};
  const int rank = space.ok() && H5Sget_simple_extent_type(space.get()) != H5S_NULL ? H5Sget_simple_extent_dims(space.get(), d, nullptr) : -1;
  if (rank < 0) return cat("dataset ", path, " has no dataspace");
  bool same = rank == shape.rank;
  for (int i = 0; same && i < rank; ++i) same = d[i] == static_cast<hsize_t>(shape[i]);
  if (!same) return cat("dataset ", path, " is ", shape_text(d, rank), ", expected ", shape.str());
  // Allocated, and when contiguous (as mpipe writes it) within the file: otherwise a read
  // returns fill values, or zeros past a truncated end, as if they were the data.
  H5D_space_status_t status{};
  if (H5Dget_space_status(set.get(), &status) < 0 || status != H5D_SPACE_STATUS_ALLOCATED)
    return cat("dataset ", path, " has no data stored (unallocated)");
  Handle create(H5Dget_create_plist(set.get()), H5Pclose);
  if (create.ok() && H5Pget_layout(create.get()) == H5D_CONTIGUOUS) {
    hsize_t file_bytes = 0;
    const haddr_t offset = H5Dget_offset(set.get());
    const hsize_t stored = H5Dget_storage_size(set.get());
    if (H5Fget_filesize(file, &file_bytes) < 0 || offset == HADDR_UNDEF ||
        stored != static_cast<hsize_t>(shape.numel()) * sizeof(float) || offset + stored > file_bytes)
      return cat("dataset ", path, "'s data lies beyond the end of the file (truncated?)");
  }
  Handle crc(H5Aexists(set.get(), "crc32") > 0 ? H5Aopen(set.get(), "crc32", H5P_DEFAULT) : H5I_INVALID_HID, H5Aclose);
  if (!crc.ok()) return cat("dataset ", path, " has no checksum");
  Handle crc_type(H5Aget_type(crc.get()), H5Tclose), crc_space(H5Aget_space(crc.get()), H5Sclose);
  if (H5Tget_class(crc_type.get()) != H5T_INTEGER || H5Sget_simple_extent_npoints(crc_space.get()) != 1)
    return cat("dataset ", path, "'s checksum is not one integer");
  return std::nullopt;
}

std::optional<std::string> read_checked(hid_t file, const std::string& path, const Shape& shape, float* out) {
  if (auto bad = check_dataset(file, path, shape)) return bad;
  const auto count = static_cast<std::size_t>(shape.numel());
  Handle set(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose);
  if (H5Dread(set.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0)
    return cat("dataset ", path, " cannot be read (truncated file?)");
  const auto stored = read_scalar_attribute<uint32_t>(set.get(), "crc32", H5T_NATIVE_UINT32);
  if (!stored) return cat("dataset ", path, " has no checksum");
  if (*stored != crc32_of(out, count * sizeof(float))) return cat("dataset ", path, " fails its checksum (altered or damaged)");
  return std::nullopt;
}

std::vector<DatasetSpec> checkpoint_datasets(const Model& model, const std::string& optimizer) {
  std::vector<DatasetSpec> all = parameter_datasets(model, "/model");
  if (optimizer.empty()) return all;
  const std::size_t params = all.size();
  for (const std::string& state : Optimizer::state_names(OptimizerConfig{.kind = optimizer}))
    for (std::size_t i = 0; i < params; ++i) {
      DatasetSpec d = all[i];
      d.path = "/optimizer/" + state + d.path.substr(std::strlen("/model"));
      all.push_back(std::move(d));
    }
  return all;
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
  if (s.version > checkpoint_format_version)
    return cat("'", path, "' has checkpoint format version ", s.version, ", newer than this mpipe's (it reads versions ",
               checkpoint_oldest_readable_version, " to ", checkpoint_format_version, ")");
  if (s.version < checkpoint_oldest_readable_version)
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

std::vector<std::string> checkpoint_files(const std::string& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (checkpoint_step_of_name(entry.path().string()) >= 0) found.push_back(entry.path().string());
  std::sort(found.rbegin(), found.rend());  // the step's 8 digits: by name is by step
  return found;
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
  } else if (c.kind == "llama") {
    s = cat("llama layers=", c.layers, " d_model=", c.d_model, " heads=", c.heads, " kv_heads=", c.kv_heads == 0 ? c.heads : c.kv_heads,
            " seq_len=", c.seq_len, " vocab=", c.vocab, " tied=", c.tie_embeddings);
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

Model checkpoint_model(hid_t file, const std::string& path) {
  const auto list = read_string_attribute(file, "model");
  MPIPE_REQUIRE(list.has_value(), "resume it with the run's options: resume checks it against that model",
                "'", path, "' has no layer list (written by mpipe before model files)");
  const std::string name = cat(path, ":model");
  Model model(ModelConfig{.kind = name}, parse_model_text(*list, name));
  // The list is outside the training state's checksum; the signature's layout is not.
  const auto signature = read_string_attribute(file, "model_signature").value_or("");
  const std::string layout = model_signature(model);
  const std::string tail = layout.substr(layout.rfind(" layout="));
  MPIPE_REQUIRE(signature.size() >= tail.size() && signature.compare(signature.size() - tail.size(), tail.size(), tail) == 0,
                "use an older checkpoint", "'", path, "': its layer list does not give the parameters its signature names (",
                signature, ")");
  return model;
}

std::optional<std::string> verify_checkpoint(const std::string& path, const Model* model, bool read_data) {
  quiet_hdf5();
  if (const std::string kind = not_a_file(path); !kind.empty()) return cat("'", path, "' ", kind);
  if (H5Fis_hdf5(path.c_str()) <= 0) return cat("'", path, "' is not an HDF5 file");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) return cat("'", path, "' cannot be opened as HDF5 (truncated or damaged)");
  const auto format = read_string_attribute(file.get(), "format");
  if (!format || *format != checkpoint_format) return cat("'", path, "' is not an mpipe checkpoint");
  TrainState state;
  if (auto bad = read_train_state(file.get(), path, state)) return bad;
  std::optional<Model> own;  // the file's own model, for inspect
  if (!model) {
    try {
      model = &own.emplace(checkpoint_model(file.get(), path));
    } catch (const UserError& e) {
      return e.what();
    }
  } else if (state.signature != model_signature(*model)) {
    const auto list = read_string_attribute(file.get(), "model");
    const std::string difference = list ? first_difference(*list, model_text(*model)) : std::string();
    return cat("'", path, "' holds another model (", difference.empty() ? state.signature : difference, ")");
  }
  std::string tokenizer_problem;  // its bytes are few: read and checked whatever read_data says
  read_checkpoint_tokenizer(file.get(), &tokenizer_problem);
  if (!tokenizer_problem.empty()) return cat("'", path, "': ", tokenizer_problem);
  if (!state.optimizer.empty() && state.optimizer != "adamw" && state.optimizer != "sgd")
    return cat("'", path, "' holds the state of an unknown optimizer '", printable_line(state.optimizer), "'");
  std::vector<float> buffer;
  for (const DatasetSpec& d : checkpoint_datasets(*model, state.optimizer)) {
    if (!read_data) {  // structure only: the data was checked as it was written, or is as it is loaded
      if (auto bad = check_dataset(file.get(), d.path, d.shape)) return cat("'", path, "': ", *bad);
      continue;
    }
    buffer.resize(static_cast<std::size_t>(d.shape.numel()));
    if (auto bad = read_checked(file.get(), d.path, d.shape, buffer.data())) return cat("'", path, "': ", *bad);
  }
  return std::nullopt;
}

std::optional<std::string> read_entry(hid_t file, const Model& model, const ParamEntry& entry, const std::string& root,
                                      float* out, std::vector<float>& rows) {
  const ParamSpec owner = owner_spec(model, entry);
  const Shape shape = owner.shape;
  float* into = out;
  if (shape.numel() != entry.numel()) {
    rows.resize(static_cast<std::size_t>(shape.numel()));
    into = rows.data();
  }
  if (auto bad = read_checked(file, root + "/" + layer_key(entry.owner_layer) + "/" + owner.name, shape, into)) return bad;
  if (into != out) std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(entry.owner_element), entry.numel(), out);
  return std::nullopt;
}

std::string newest_verified_checkpoint(const std::string& dir) {
  const std::vector<std::string> found = checkpoint_files(dir);
  for (const std::string& path : found) {
    const auto bad = verify_checkpoint(path);
    if (!bad) return path;
    std::fprintf(stderr, "mpipe: warning: %s; trying an older checkpoint\n", bad->c_str());
  }
  throw UserError(cat("no checkpoint in '", dir, "' verifies (", found.size(), " found)"),
                  "give a checkpoint file, or the --checkpoint-dir of a run that saved one");
}

CheckpointToRead open_checkpoint_to_read(const std::string& checkpoint, const std::string& verb, bool verify) {
  quiet_hdf5();
  std::error_code ec;
  MPIPE_REQUIRE(std::filesystem::exists(checkpoint, ec), "give a checkpoint file (ckpt-*.h5) or a run's --checkpoint-dir",
                "no file '", checkpoint, "'");
  std::string path = std::filesystem::is_directory(checkpoint, ec) ? newest_verified_checkpoint(checkpoint) : checkpoint;
  MPIPE_REQUIRE(H5Fis_hdf5(path.c_str()) > 0, "mpipe checkpoints are HDF5 files (ckpt-*.h5)", "'", path,
                "' is not an HDF5 file");
  // The whole file first, as resume checks it: nothing is read from a damaged one.
  if (auto bad = verify ? verify_checkpoint(path) : std::nullopt) {
    // An older checkpoint helps where this one is damaged, not where it is none of
    // mpipe's, or one of a newer mpipe's.
    const bool foreign = bad->find("is not an mpipe checkpoint") != std::string::npos;
    const bool newer = bad->find(", newer than this mpipe's") != std::string::npos;
    throw UserError(*bad, foreign ? "give a checkpoint file mpipe wrote (ckpt-*.h5), or a run's --checkpoint-dir"
                          : newer ? "use the mpipe that wrote it, or a newer one"
                                  : cat(verb, " an older checkpoint (mpipe inspect --verify finds one)"));
  }
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  MPIPE_REQUIRE(file.ok(), "the file is damaged; use an older checkpoint", "'", path, "' cannot be opened");
  Model model = checkpoint_model(file.get(), path);
  std::int64_t step = -1;
  if (Handle train(H5Gopen2(file.get(), "/train", H5P_DEFAULT), H5Gclose); train.ok())
    step = read_scalar_attribute<std::int64_t>(train.get(), "step", H5T_NATIVE_INT64).value_or(-1);
  return {std::move(path), std::move(file), std::move(model), step};
}

}  // namespace mpipe
