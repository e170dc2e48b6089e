// HDF5 checkpoints: parallel write, verification, atomic replacement, resume, inspect.
#include "mpipe/io/checkpoint.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "mpipe/core/version.hpp"
#include "mpipe/data/hdf5.hpp"
#include "mpipe/io/config_file.hpp"
#include "mpipe/pipeline/watchdog.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {

// ---- small HDF5 helpers (Handle and quiet_hdf5 in data/hdf5.hpp) ----------------

// The model's layer list as a model file, without the name line (the same list read
// from another path is the same model).
std::string model_text(const Model& model) {
  ModelSpec spec = model.spec();
  spec.name.clear();
  const std::string text = spec.to_toml();
  return text.substr(text.find('\n') + 1);
}

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

#define H5_CHECK(expr, ...)                                                    \
  do {                                                                         \
    if ((expr) < 0) throw Error(cat("HDF5: ", __VA_ARGS__));                   \
  } while (0)

uint32_t crc32_of(const void* data, std::size_t bytes) {
  return static_cast<uint32_t>(crc32_z(0L, static_cast<const Bytef*>(data), bytes));
}

std::string layer_key(int layer) {
  char text[16];
  std::snprintf(text, sizeof text, "%04d", layer);
  return text;
}

// One dataset of parameters or optimizer state, as every rank names it.
struct DatasetSpec {
  std::string path;
  Shape shape;
  int layer;
  std::string name;
};

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

template <class T>
void write_scalar_attribute(hid_t object, const char* name, hid_t type, T value) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(object, name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  H5_CHECK(attr.get(), "cannot create attribute ", name);
  H5_CHECK(H5Awrite(attr.get(), type, &value), "cannot write attribute ", name);
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

template <class T>
std::optional<T> read_scalar_attribute(hid_t object, const char* name, hid_t type) {
  if (H5Aexists(object, name) <= 0) return std::nullopt;
  Handle attr(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
  T value{};
  if (H5Aread(attr.get(), type, &value) < 0) return std::nullopt;
  return value;
}

// Reads a float dataset of `count` elements into `out` and checks its CRC-32.
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

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Which stage writes each parameter dataset (and its optimizer state): the stage
// holding its layer, except that a tied weight held by two stages (GPT's embedding and
// head) is written by whichever of the two has less else to write, so the writers'
// shares of the file are closer to even.
std::vector<int> writer_stages(const Model& model, const Partition& part, const std::vector<DatasetSpec>& params) {
  std::vector<int> writer(params.size());
  std::vector<double> bytes(part.stages(), 0.0);
  std::vector<int> copy_stage(params.size(), -1);
  for (std::size_t i = 0; i < params.size(); ++i) {
    writer[i] = part.stage_of(params[i].layer);
    // A copy of all of it (not of some rows: a vocabulary chunk of the head) may write it.
    const auto ties = model.ties_of(params[i].layer, params[i].name);
    if (ties.size() == 1 && ties[0]->whole) copy_stage[i] = part.stage_of(ties[0]->copy_layer);
    if (copy_stage[i] < 0 || copy_stage[i] == writer[i]) bytes[writer[i]] += static_cast<double>(params[i].shape.numel());
  }
  for (std::size_t i = 0; i < params.size(); ++i)
    if (copy_stage[i] >= 0 && copy_stage[i] != writer[i]) {
      if (bytes[copy_stage[i]] < bytes[writer[i]]) writer[i] = copy_stage[i];
      bytes[writer[i]] += static_cast<double>(params[i].shape.numel());
    }
  return writer;
}

// What steers a resume: /train's attributes and the root attributes that say which
// model, optimizer and options the state belongs to. Version 2 covers them all by one
// CRC-32 (/train's `crc32`) of state_text, so an altered step cannot pass for a real one.
struct TrainState {
  int version = checkpoint_format_version;
  int64_t step = 0, updates = 0, samples = 0, position = 0;
  uint64_t seed = 0;
  std::string data, run_id, signature, optimizer, config;
};

std::string state_text(const TrainState& s) {
  return cat("step=", s.step, "\nupdates=", s.updates, "\nsamples=", s.samples, "\nposition=", s.position,
             "\nseed=", s.seed, "\ndata=", s.data, "\nrun=", s.run_id, "\nsignature=", s.signature,
             "\noptimizer=", s.optimizer, "\nconfig=", s.config);
}

// Reads and checks the training state of an open checkpoint: present, within the
// checksum (version 2), and consistent (updates <= step, samples = data position, the
// step the file's name gives). Returns the problem, or nothing.
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

// Direct I/O needs buffers, offsets and sizes aligned to the device's blocks.
constexpr std::size_t direct_alignment = 4096;
constexpr std::size_t staging_bytes = 16u << 20;

// Writes `bytes` at `offset` of the file: the block-aligned body with O_DIRECT through
// an aligned staging buffer (no page-cache copy, which on many machines is slower
// than the disk), the rest through the page cache.
void write_raw(int direct_fd, int buffered_fd, const void* source, std::size_t bytes, std::uint64_t offset,
               std::byte* staging, const std::string& what) {
  const auto* src = static_cast<const std::byte*>(source);
  std::size_t body = 0;
  if (direct_fd >= 0 && offset % direct_alignment == 0) body = bytes / direct_alignment * direct_alignment;
  for (std::size_t done = 0; done < body;) {
    const std::size_t n = std::min(staging_bytes, body - done);
    std::memcpy(staging, src + done, n);
    const ssize_t w = ::pwrite(direct_fd, staging, n, static_cast<off_t>(offset + done));
    if (w <= 0) throw Error(cat("cannot write ", what, ": ", std::strerror(errno), " (disk full?)"));
    done += static_cast<std::size_t>(w);
  }
  for (std::size_t done = body; done < bytes;) {
    const ssize_t w = ::pwrite(buffered_fd, src + done, bytes - done, static_cast<off_t>(offset + done));
    if (w <= 0) throw Error(cat("cannot write ", what, ": ", std::strerror(errno), " (disk full?)"));
    done += static_cast<std::size_t>(w);
  }
}

// One writer's part of a checkpoint (collective over replica 0's ranks). HDF5 creates
// every dataset on every writer (its metadata is collective) with space allocated at
// creation; each writer then writes only its own layers' data: with HDF5's MPI-IO
// driver, or, where the file system takes O_DIRECT, straight to the offsets HDF5
// allocated once the file is closed (MPIPE_CHECKPOINT_BUFFERED=1 forces the former).
struct WriteTimes {
  double write = 0, read_back = 0;
  bool data_checked = false;  // this writer read its data back against the checksums
};

WriteTimes write_file(Executor& exec, const std::string& temp_path, const std::string& run_id, std::int64_t step) {
  const auto start = std::chrono::steady_clock::now();
  auto since = [](auto from) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count(); };
  WriteTimes times;
  const TrainConfig& config = exec.config();
  const Grid& grid = exec.grid();
  const Model& model = exec.model();
  const Communicator& comm = grid.pipeline();
  const auto params = parameter_datasets(model, "/model");
  const auto names = exec.optimizer().state_names();
  std::vector<DatasetSpec> all = params;  // parameters, then each optimizer state with the same keys
  for (const std::string& state : names)
    for (const DatasetSpec& d : params)
      all.push_back({"/optimizer/" + state + d.path.substr(std::strlen("/model")), d.shape, d.layer, d.name});

  // This rank's datasets and the checksums every writer must agree on.
  struct Mine {
    std::size_t index;
    const float* data;
    std::size_t bytes;
    haddr_t offset = HADDR_UNDEF;
  };
  std::vector<Mine> mine;
  const std::vector<int> writers = writer_stages(model, exec.partition(), params);
  std::vector<unsigned> crcs(all.size(), 0);  // uint32 CRCs
  const ParamStore& store = exec.params();
  for (std::size_t i = 0; i < all.size(); ++i) {
    const DatasetSpec& d = all[i];
    if (exec.partition().pipeline_stage(writers[i % params.size()]) != grid.stage()) continue;
    const ParamEntry* entry = nullptr;
    for (const ParamEntry& e : store.entries())
      if (!e.alias && e.owner_layer == d.layer &&
          (e.tied_copy ? model.layer(d.layer).param_specs()[e.owner_index].name == d.name : e.name == d.name))
        entry = &e;
    MPIPE_CHECK(entry, "no entry for ", d.path);
    const std::size_t which = i / params.size();  // 0 parameters, 1.. optimizer states
    const float* data = which == 0 ? store.params().data() + entry->param_offset
                                   : exec.optimizer().state(static_cast<int>(which - 1)).data() + entry->offset;
    const std::size_t bytes = static_cast<std::size_t>(entry->numel()) * sizeof(float);
    crcs[i] = crc32_of(data, bytes);
    mine.push_back({i, data, bytes});
  }
  comm.allreduce(std::span<unsigned>(crcs), Reduce::max);

  int direct_fd = -1;
  {
    Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    H5Pset_fapl_mpio(fapl.get(), comm.get(), MPI_INFO_NULL);
    H5Pset_coll_metadata_write(fapl.get(), true);
    H5Pset_alignment(fapl.get(), direct_alignment, direct_alignment);  // datasets start on blocks
    Handle file(H5Fcreate(temp_path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
    H5_CHECK(file.get(), "cannot create '", temp_path, "'");
    if (!std::getenv("MPIPE_CHECKPOINT_BUFFERED")) direct_fd = ::open(temp_path.c_str(), O_WRONLY | O_DIRECT);
    Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
    H5Pset_create_intermediate_group(lcpl.get(), 1);
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
    H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY);
    std::vector<Handle> sets;
    for (std::size_t i = 0; i < all.size(); ++i) {
      const auto dd = dims(all[i].shape);
      Handle space(H5Screate_simple(static_cast<int>(dd.size()), dd.data(), nullptr), H5Sclose);
      sets.emplace_back(H5Dcreate2(file.get(), all[i].path.c_str(), H5T_IEEE_F32LE, space.get(), lcpl.get(), dcpl.get(),
                                   H5P_DEFAULT), H5Dclose);
      H5_CHECK(sets.back().get(), "cannot create ", all[i].path);
      write_scalar_attribute<uint32_t>(sets.back().get(), "crc32", H5T_STD_U32LE, crcs[i]);
    }
    for (Mine& m : mine) {
      if (direct_fd >= 0) {
        m.offset = H5Dget_offset(sets[m.index].get());
        H5_CHECK(m.offset == HADDR_UNDEF ? -1 : 0, "no file offset for ", all[m.index].path);
      } else {
        H5_CHECK(H5Dwrite(sets[m.index].get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, m.data), "cannot write ",
                 all[m.index].path, " (disk full?)");
      }
    }
    sets.clear();
    // Training state and provenance, the same on every writer.
    TrainState state;
    state.step = step;
    state.updates = exec.updates();
    state.samples = state.position = step * config.batch_size;
    state.seed = config.seed;
    state.data = config.data;
    state.run_id = run_id;
    state.signature = model_signature(model);
    state.optimizer = config.optimizer.kind;
    state.config = to_toml(config);
    const std::string text = state_text(state);
    Handle train(H5Gcreate2(file.get(), "/train", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    write_scalar_attribute<int64_t>(train.get(), "step", H5T_STD_I64LE, state.step);
    write_scalar_attribute<int64_t>(train.get(), "optimizer_updates", H5T_STD_I64LE, state.updates);
    write_scalar_attribute<int64_t>(train.get(), "samples_consumed", H5T_STD_I64LE, state.samples);
    write_scalar_attribute<int64_t>(train.get(), "data_position", H5T_STD_I64LE, state.position);
    write_scalar_attribute<uint64_t>(train.get(), "seed", H5T_STD_U64LE, state.seed);
    write_string_attribute(train.get(), "data", state.data);
    write_string_attribute(train.get(), "run_id", state.run_id);
    write_scalar_attribute<uint32_t>(train.get(), "crc32", H5T_STD_U32LE, crc32_of(text.data(), text.size()));
    write_string_attribute(file.get(), "format", checkpoint_format);
    write_scalar_attribute<int>(file.get(), "format_version", H5T_STD_I32LE, checkpoint_format_version);
    write_string_attribute(file.get(), "mpipe_version", cat(version(), " (git ", git_hash(), ")"));
    write_string_attribute(file.get(), "model_signature", state.signature);
    write_string_attribute(file.get(), "optimizer", state.optimizer);
    write_string_attribute(file.get(), "config", state.config);
    write_string_attribute(file.get(), "model", model_text(model));  // its layer list, as a model file
    H5_CHECK(H5Fflush(file.get(), H5F_SCOPE_GLOBAL), "cannot flush '", temp_path, "'");
  }  // the file is closed (collectively) here; HDF5 writes nothing more
  // A collective close may return on one writer while another still writes metadata:
  // no raw data goes in before every writer is out of HDF5.
  comm.barrier();
  if (direct_fd >= 0) {
    const int buffered_fd = ::open(temp_path.c_str(), O_WRONLY);
    std::unique_ptr<std::byte, decltype(&std::free)> staging(
        static_cast<std::byte*>(std::aligned_alloc(direct_alignment, staging_bytes)), &std::free);
    try {
      if (buffered_fd < 0 || !staging) throw Error(cat("cannot reopen '", temp_path, "': ", std::strerror(errno)));
      for (const Mine& m : mine) write_raw(direct_fd, buffered_fd, m.data, m.bytes, m.offset, staging.get(), all[m.index].path);
      if (::fsync(buffered_fd) != 0 || ::fsync(direct_fd) != 0)
        throw Error(cat("cannot fsync '", temp_path, "': ", std::strerror(errno)));
      times.write = since(start);
      const auto read_start = std::chrono::steady_clock::now();
      // Read back what reached the file, past the page cache, against the checksums.
      const int reader = ::open(temp_path.c_str(), O_RDONLY | O_DIRECT);
      const int plain_reader = ::open(temp_path.c_str(), O_RDONLY);
      std::string bad;
      std::vector<std::byte> rest;
      for (const Mine& m : mine) {
        if (reader < 0 || plain_reader < 0) {
          bad = cat("cannot reopen '", temp_path, "': ", std::strerror(errno));
          break;
        }
        uLong crc = 0;
        const std::size_t body = m.offset % direct_alignment == 0 ? m.bytes / direct_alignment * direct_alignment : 0;
        for (std::size_t done = 0; done < body && bad.empty();) {
          const ssize_t r = ::pread(reader, staging.get(), std::min(staging_bytes, body - done), static_cast<off_t>(m.offset + done));
          if (r <= 0) bad = cat("cannot read back ", all[m.index].path);
          else crc = crc32_z(crc, reinterpret_cast<const Bytef*>(staging.get()), static_cast<std::size_t>(r));
          done += r > 0 ? static_cast<std::size_t>(r) : 0;
        }
        rest.resize(m.bytes - body);
        if (bad.empty() && !rest.empty() &&
            ::pread(plain_reader, rest.data(), rest.size(), static_cast<off_t>(m.offset + body)) != static_cast<ssize_t>(rest.size()))
          bad = cat("cannot read back ", all[m.index].path);
        // (crc32_z with a null buffer returns the initial value, not crc: skip it when empty)
        if (!rest.empty()) crc = crc32_z(crc, reinterpret_cast<const Bytef*>(rest.data()), rest.size());
        if (bad.empty() && static_cast<uint32_t>(crc) != crcs[m.index])
          bad = cat("read-back of ", all[m.index].path, " does not match what was written (offset ", m.offset, ", ", m.bytes, " bytes, body ", body, ")");
        if (!bad.empty()) break;
      }
      if (reader >= 0) ::close(reader);
      if (plain_reader >= 0) ::close(plain_reader);
      if (!bad.empty()) throw Error(bad);
      times.read_back = since(read_start);
      times.data_checked = true;
    } catch (...) {
      ::close(direct_fd);
      if (buffered_fd >= 0) ::close(buffered_fd);
      throw;
    }
    ::close(direct_fd);
    ::close(buffered_fd);
  } else {
    const int fd = ::open(temp_path.c_str(), O_RDONLY);
    if (fd >= 0) {
      ::fsync(fd);
      ::close(fd);
    }
    times.write = since(start);
  }
  return times;
}

}  // namespace

// ---- names, signature, config ------------------------------------------------------

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

// ---- verification --------------------------------------------------------------------

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

void check_checkpoint_options(const TrainConfig& c, bool create) {
  MPIPE_REQUIRE(c.checkpoint_every >= 0, "e.g. --checkpoint-every 100", "--checkpoint-every must be >= 0, got ",
                c.checkpoint_every);
  MPIPE_REQUIRE(c.keep >= 0, "e.g. --keep 3 (0 keeps all)", "--keep must be >= 0, got ", c.keep);
  if (c.checkpoint_dir.empty()) {
    MPIPE_REQUIRE(c.checkpoint_every == 0, "give --checkpoint-dir DIR", "--checkpoint-every needs --checkpoint-dir");
  } else {
    std::error_code ec;
    if (create && !fs::is_directory(c.checkpoint_dir, ec)) {
      fs::create_directories(c.checkpoint_dir, ec);
      if (ec) {
        // Name the part of the path that is in the way: a regular file, or a directory
        // this user may not write to.
        fs::path blocker = fs::path(c.checkpoint_dir);
        std::error_code e2;
        while (blocker.has_parent_path() && blocker != blocker.parent_path() && !fs::exists(blocker, e2))
          blocker = blocker.parent_path();
        const std::string hint =
            fs::exists(blocker, e2) && !fs::is_directory(blocker, e2)
                ? cat("'", blocker.string(), "' is a file, not a directory: choose another --checkpoint-dir")
                : "choose a --checkpoint-dir under a directory you can write to";
        throw UserError(cat("cannot create checkpoint directory '", c.checkpoint_dir, "': ", ec.message()), hint);
      }
    }
    MPIPE_REQUIRE(fs::is_directory(c.checkpoint_dir, ec), "give a directory (it is created if missing)",
                  "checkpoint directory '", c.checkpoint_dir, "' is not a directory");
    MPIPE_REQUIRE(::access(c.checkpoint_dir.c_str(), W_OK | X_OK) == 0, "choose a directory you can write to",
                  "checkpoint directory '", c.checkpoint_dir, "' is not writable");
  }
  if (c.resume != "auto" && c.resume != "never") {
    MPIPE_REQUIRE(fs::is_regular_file(c.resume), "give --resume auto, never or an existing checkpoint file",
                  "--resume: no checkpoint file '", c.resume, "'");
  }
}

// ---- saving --------------------------------------------------------------------------

SaveResult save_checkpoint(Executor& exec, CheckpointDir& dir, std::int64_t step, Watchdog* liveness) {
  quiet_hdf5();
  auto seconds = [](auto from) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count(); };
  SaveResult result;
  const TrainConfig& config = exec.config();
  const Grid& grid = exec.grid();
  const Communicator& world = grid.world();
  const std::string final_path = checkpoint_path(config.checkpoint_dir, step);
  const std::string temp_path = (fs::path(config.checkpoint_dir) / ("." + fs::path(final_path).filename().string() + ".tmp")).string();
  const Model& model = exec.model();
  // Every wait below is collective (MPI, HDF5's file create and close): a rank that
  // stopped answering must end the job, not leave the others waiting. Those stopped
  // before the checkpoint are named here; one that stops within it, by the watchdog's
  // heartbeats within --p2p-timeout, however large the file. Its deadline, which allows
  // a healthy write at 10 MB/s, bounds a write that every rank is still doing.
  const double timeout = config.pipeline.p2p_timeout;
  rendezvous(world, cat("checkpoint step ", step), timeout, liveness);
  std::optional<Watchdog> own;
  Watchdog& watchdog = liveness ? *liveness : own.emplace(world, grid.name(), timeout);
  const double file_bytes = 4.0 * static_cast<double>(model.parameter_count()) *
                            static_cast<double>(1 + exec.optimizer().state_names().size());
  const auto guard = watchdog.arm(cat("writing checkpoint ", final_path), timeout + file_bytes / 10e6);
  exec.download_state();  // on a GPU: the values and optimizer state to the host mirrors
  int failed = 0;
  std::string problem;

  WriteTimes times;
  if (grid.replica() == 0) {
    try {
      times = write_file(exec, temp_path, dir.run_id(), step);
    } catch (const std::exception& e) {
      failed = 1;
      problem = e.what();
    }
  }
  // Agree before world rank 0 (a writer) verifies and renames; the slowest writer's
  // times are the checkpoint's.
  // (the last entry is 1 where some writer did not read its data back)
  double agreed[4] = {static_cast<double>(failed), times.write, times.read_back,
                      grid.replica() == 0 && !times.data_checked ? 1.0 : 0.0};
  world.allreduce(std::span<double>(agreed), Reduce::max);
  failed = static_cast<int>(agreed[0]);
  result.write_seconds = agreed[1];
  if (!failed && world.rank() == 0) {
    try {
      result.bytes = static_cast<double>(fs::file_size(temp_path));
      const auto verify_start = std::chrono::steady_clock::now();
      // Each writer read its own data back against its checksum (or HDF5 wrote it and
      // the structure check below reads it all); here the file as a whole: HDF5,
      // format, model, every dataset present with a checksum.
      const bool data_checked = agreed[3] == 0.0;
      if (auto bad = verify_checkpoint(temp_path, &model, !data_checked))
        throw Error(cat("verification failed: ", *bad));
      dir.make_way(final_path);
      std::error_code ec;
      fs::rename(temp_path, final_path, ec);
      if (ec) throw Error(cat("cannot rename '", temp_path, "' to '", final_path, "': ", ec.message()));
      fsync_path(config.checkpoint_dir, true);
      result.verify_seconds = agreed[2] + seconds(verify_start);
      // Only now that the new one is in place: older files of this run beyond --keep,
      // and (--overwrite) the other run's.
      dir.after_save(final_path);
    } catch (const std::exception& e) {
      failed = 2;
      problem = e.what();
    }
  }
  world.broadcast(std::span<int>(&failed, 1), 0);
  if (failed) {
    std::error_code ec;
    if (world.rank() == 0) fs::remove(temp_path, ec);  // never leave a partial file behind
    if (!problem.empty()) throw Error(cat("checkpoint ", final_path, ": ", problem));
    throw Error(cat("checkpoint ", final_path, " failed on another rank"));
  }
  result.path = final_path;
  return result;
}

// ---- resuming ----------------------------------------------------------------------

std::vector<std::string> resume_candidates(const TrainConfig& config, const Model& model, const Communicator& world) {
  // Rank 0 looks; the files' structure is checked here, their data as it is loaded.
  std::vector<std::string> chosen;
  std::string error;
  if (world.rank() == 0 && config.resume != "never") {
    if (config.resume != "auto") {
      if (auto bad = verify_checkpoint(config.resume, &model, false)) error = *bad;
      else chosen.push_back(config.resume);
    } else if (!config.checkpoint_dir.empty()) {
      std::vector<std::string> found;
      for (const auto& entry : fs::directory_iterator(config.checkpoint_dir)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind(".ckpt-", 0) == 0 && name.size() > 4 && name.substr(name.size() - 4) == ".tmp") {
          std::error_code ec;
          fs::remove(entry.path(), ec);  // a stray temporary from a run that died while writing
        } else if (checkpoint_step_of_name(name) >= 0) {
          found.push_back(entry.path().string());
        }
      }
      std::sort(found.rbegin(), found.rend());  // newest first
      for (const std::string& c : found) {
        if (auto bad = verify_checkpoint(c, &model, false)) std::fprintf(stderr, "mpipe: warning: skipping checkpoint: %s\n", bad->c_str());
        else chosen.push_back(c);
      }
    }
  }
  // Broadcast the list (or the error) from rank 0, one path per line.
  int code = error.empty() ? 0 : 1;
  world.broadcast(std::span<int>(&code, 1), 0);
  std::string text = error;
  if (!code)
    for (const std::string& c : chosen) text += c + "\n";
  world.broadcast(text, 0);
  if (code) throw UserError(cat("cannot resume: ", text), "give a good checkpoint, or --resume auto / never");
  std::vector<std::string> out;
  std::stringstream lines(text);
  for (std::string line; std::getline(lines, line);) out.push_back(line);
  return out;
}

namespace {
// A checkpoint that loads but must not be continued as asked: never skipped for an
// older one, whatever --resume says.
struct Refused : UserError {
  using UserError::UserError;
};
}  // namespace

std::string resume(Executor& exec, CheckpointDir& dir, std::int64_t* step) {
  const TrainConfig& config = exec.config();
  const Communicator& world = exec.grid().world();
  const std::vector<std::string> candidates = resume_candidates(config, exec.model(), world);
  std::string failures;
  for (const std::string& path : candidates) {
    try {
      std::string run_id;
      *step = load_checkpoint(exec, path, &run_id);
      if (!failures.empty() && world.rank() == 0) std::fflush(stdout);
      if (*step > config.steps)
        throw Refused(cat("checkpoint '", path, "' is at step ", *step, ", beyond --steps ", config.steps,
                          "; nothing to do"),
                      cat("give --steps more than ", *step, " to train on, or --resume never to start again"));
      dir.adopt(run_id);
      return path;
    } catch (const Refused&) {
      throw;
    } catch (const UserError& e) {
      if (config.resume != "auto") throw UserError(cat("cannot resume: ", e.what()), e.hint());
      if (world.rank() == 0) std::fprintf(stderr, "mpipe: warning: skipping checkpoint: %s\n", e.what());
      failures += cat(failures.empty() ? "" : "; ", path);
    }
  }
  // Parameters partly overwritten by a failed load must not be trained on.
  MPIPE_REQUIRE(failures.empty(), cat("move the damaged files away, or use --resume never"),
                "no checkpoint in '", config.checkpoint_dir, "' loads (", failures, ")");
  return "";
}

std::int64_t load_checkpoint(Executor& exec, const std::string& path, std::string* run_id) {
  quiet_hdf5();
  ParamStore& store = exec.params();
  std::string problem, other_optimizer;
  TrainState state;
  try {
    Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    H5_CHECK(file.get(), "cannot open '", path, "'");
    if (auto bad = read_train_state(file.get(), path, state)) throw Error(*bad);
    // Another optimizer's state cannot continue this one's: say so rather than drop it.
    if (!state.optimizer.empty() && state.optimizer != exec.config().optimizer.kind) {
      other_optimizer = state.optimizer;
      throw Error("optimizer mismatch");
    }
    const auto names = exec.optimizer().state_names();
    std::vector<float> rows;  // a row copy's owner, whole
    for (const ParamEntry& e : store.entries()) {
      if (e.alias) continue;  // the owner's values, loaded with the owner
      // A tied copy on another stage loads the owner's values and state.
      const std::string key = "/" + layer_key(e.owner_layer) + "/" +
                              (e.tied_copy ? exec.model().layer(e.owner_layer).param_specs()[e.owner_index].name : e.name);
      // A copy of some of the owner's rows reads the owner's dataset and keeps its rows.
      const std::size_t whole = e.tied_copy ? static_cast<std::size_t>(
                                                  exec.model().layer(e.owner_layer).param_specs()[e.owner_index].shape.numel())
                                            : static_cast<std::size_t>(e.numel());
      auto read = [&](const std::string& name, float* out) {
        float* into = out;
        if (whole != static_cast<std::size_t>(e.numel())) {
          rows.resize(whole);
          into = rows.data();
        }
        if (auto p = read_checked(file.get(), name, into, whole)) throw Error(cat("'", path, "': ", *p));
        if (into != out) std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(e.owner_element), e.numel(), out);
      };
      read("/model" + key, store.params().data() + e.param_offset);
      if (!state.optimizer.empty())
        for (std::size_t s = 0; s < names.size(); ++s)
          read("/optimizer/" + names[s] + key, exec.optimizer().state(static_cast<int>(s)).data() + e.offset);
    }
  } catch (const std::exception& e) {
    problem = e.what();
  }
  int failed = problem.empty() ? 0 : 1;
  const Communicator& world = exec.grid().world();
  world.allreduce(std::span<int>(&failed, 1), Reduce::max);
  if (!other_optimizer.empty())  // every rank reads the same attribute
    throw Refused(cat("checkpoint '", path, "' holds ", other_optimizer, " optimizer state; this run uses --optimizer ",
                      exec.config().optimizer.kind),
                  cat("use --optimizer ", other_optimizer, " to continue it, or --resume never to start again"));
  if (failed) throw UserError(problem.empty() ? cat("'", path, "': failed on another rank") : problem,
                              "check the file with 'mpipe inspect --verify'");
  exec.set_updates(state.updates);
  exec.upload_state();  // on a GPU: the loaded values and state into device memory
  if (run_id) *run_id = state.run_id;
  return state.step;
}

// ---- inspect -------------------------------------------------------------------------

int run_inspect(const std::string& path, bool stats, bool verify, const std::string& print) {
  quiet_hdf5();
  MPIPE_REQUIRE(fs::is_regular_file(path), "give the path of a checkpoint file", "no file '", path, "'");
  MPIPE_REQUIRE(H5Fis_hdf5(path.c_str()) > 0, "mpipe checkpoints are HDF5 files (ckpt-*.h5)",
                "'", path, "' is not an HDF5 file");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  MPIPE_REQUIRE(file.ok(), "the file is damaged; use an older checkpoint", "'", path, "' cannot be opened");
  const auto format = read_string_attribute(file.get(), "format");
  MPIPE_REQUIRE(format && *format == checkpoint_format, "this is some other HDF5 file", "'", path,
                "' is not an mpipe checkpoint");
  if (!print.empty()) {  // the run's options or its layer list alone, as train reads them
    const auto text = read_string_attribute(file.get(), print.c_str());
    MPIPE_REQUIRE(text.has_value(), print == "model" ? "checkpoints of mpipe before model files have none" : "the file is damaged; use an older checkpoint",
                  "'", path, "' has no ", print, " attribute");
    std::printf("# the %s of the run that wrote %s\n%s", print == "model" ? "model" : "options", path.c_str(), text->c_str());
    return 0;
  }
  std::printf("%s\n", path.c_str());
  for (const char* a : {"format", "mpipe_version", "model_signature", "optimizer"})
    std::printf("  %-16s %s\n", a, read_string_attribute(file.get(), a).value_or("?").c_str());
  std::printf("  %-16s %d\n", "format_version", read_scalar_attribute<int>(file.get(), "format_version", H5T_NATIVE_INT).value_or(-1));
  {
    Handle train(H5Gopen2(file.get(), "/train", H5P_DEFAULT), H5Gclose);
    if (train.ok()) {
      for (const char* a : {"step", "optimizer_updates", "samples_consumed"})
        std::printf("  %-16s %lld\n", a,
                    static_cast<long long>(read_scalar_attribute<int64_t>(train.get(), a, H5T_NATIVE_INT64).value_or(-1)));
      std::printf("  %-16s %s\n", "run_id", read_string_attribute(train.get(), "run_id").value_or("(none)").c_str());
    }
  }
  // The tree, with per-layer parameter counts.
  struct Walk {
    hid_t file;
    bool stats;
    std::vector<std::pair<std::string, long long>> per_layer;
    long long total = 0;
  } walk{file.get(), stats, {}, 0};
  std::printf("tree:\n");
  H5Ovisit2(
      file.get(), H5_INDEX_NAME, H5_ITER_NATIVE,
      [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
        auto* w = static_cast<Walk*>(data);
        const std::string n = name;
        if (info->type == H5O_TYPE_GROUP) {
          if (n != ".") std::printf("  /%s/\n", name);
          return 0;
        }
        if (info->type != H5O_TYPE_DATASET) return 0;
        Handle set(H5Dopen2(w->file, name, H5P_DEFAULT), H5Dclose);
        Handle space(H5Dget_space(set.get()), H5Sclose);
        hsize_t d[8] = {};
        const int rank = H5Sget_simple_extent_dims(space.get(), d, nullptr);
        std::string shape = "(";
        for (int i = 0; i < rank; ++i) shape += (i ? ", " : "") + std::to_string(d[i]);
        shape += ")";
        const long long count = H5Sget_simple_extent_npoints(space.get());
        std::printf("  /%-40s float32 %-16s", name, shape.c_str());
        if (n.rfind("model/", 0) == 0) {
          w->total += count;
          const std::string layer = n.substr(6, n.find('/', 6) - 6);
          if (w->per_layer.empty() || w->per_layer.back().first != layer) w->per_layer.emplace_back(layer, 0);
          w->per_layer.back().second += count;
        }
        if (w->stats) {
          std::vector<float> v(static_cast<std::size_t>(count));
          if (H5Dread(set.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) >= 0 && count > 0) {
            double lo = v[0], hi = v[0], sum = 0, sq = 0;
            for (float x : v) {
              lo = std::min<double>(lo, x);
              hi = std::max<double>(hi, x);
              sum += x;
              sq += static_cast<double>(x) * x;
            }
            const double mean = sum / count;
            std::printf(" min %+.4e max %+.4e mean %+.4e std %.4e norm %.4e", lo, hi, mean,
                        std::sqrt(std::max(0.0, sq / count - mean * mean)), std::sqrt(sq));
          }
        }
        std::printf("\n");
        return 0;
      },
      &walk, H5O_INFO_BASIC);
  std::printf("parameters per layer:");
  for (const auto& [layer, count] : walk.per_layer) std::printf(" %s:%lld", layer.c_str(), count);
  std::printf("\nparameters: %lld\n", walk.total);
  std::printf("config:\n%s", read_string_attribute(file.get(), "config").value_or("?\n").c_str());
  if (verify) {
    if (auto bad = verify_checkpoint(path)) {
      std::printf("verify: FAILED\n");
      throw UserError(cat("checkpoint damaged: ", *bad), "use an older checkpoint");
    }
    std::printf("verify: every checksum matches\n");
  }
  return 0;
}

}  // namespace mpipe
