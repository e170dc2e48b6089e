// HDF5 checkpoints, collectively: the parallel write (MPI-IO or direct I/O), its
// verification and atomic replacement, resume and load.
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

#include "mpipe/data/hdf5.hpp"
#include "mpipe/pipeline/comm/watchdog.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {

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

// One writer's part of a checkpoint (collective over replica 0's ranks, or over every
// rank with --shard-optimizer, where each replica writes its pieces of /optimizer). HDF5
// creates every dataset on every writer (its metadata is collective) with space
// allocated at creation; each writer then writes only its own layers' data (or rows of
// them): with HDF5's MPI-IO driver, or, where the file system takes O_DIRECT, straight
// to the offsets HDF5 allocated once the file is closed (MPIPE_CHECKPOINT_BUFFERED=1
// forces the former). A dataset written in pieces gets the checksum of the whole, the
// pieces' checksums combined in row order.
struct WriteTimes {
  double write = 0, read_back = 0;
  bool data_checked = false;  // this writer read its data back against the checksums
};

WriteTimes write_file(const Executor& exec, const SaveSource& source, const Communicator& world,
                      const Communicator& pipeline, const std::string& temp_path, const CheckpointDir& dir,
                      std::int64_t step) {
  const auto start = std::chrono::steady_clock::now();
  auto since = [](auto from) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count(); };
  WriteTimes times;
  const RunOptions& options = exec.options();
  const Grid& grid = exec.grid();
  const Model& model = exec.model();
  const Optimizer& optimizer = exec.optimizer();
  const bool sharded = optimizer.sharded();
  const int parts = optimizer.parts();  // pieces a dataset may be written in
  const Communicator& comm = sharded ? world : pipeline;
  const auto params = parameter_datasets(model, "/model");
  // Parameters, then each optimizer state with the same keys.
  const std::vector<DatasetSpec> all = checkpoint_datasets(model, options.optimizer.kind);

  // This rank's datasets (or pieces of them) and the checksums every writer must agree on.
  struct Mine {
    std::size_t index;
    const float* data;
    std::size_t bytes;
    std::size_t element = 0;  // where in the dataset the piece starts (whole rows)
    unsigned crc = 0;         // of the piece
    haddr_t offset = HADDR_UNDEF;
  };
  std::vector<Mine> mine;
  const std::vector<int> writers = writer_stages(model, exec.partition(), params);
  // Each dataset's pieces, in row order: [dataset * parts + piece].
  std::vector<unsigned> piece_crcs(all.size() * static_cast<std::size_t>(parts), 0);  // uint32 CRCs
  std::vector<double> piece_bytes(piece_crcs.size(), 0.0);
  const ParamStore& store = exec.params();
  std::vector<float> zeros;  // the state of views no optimizer piece holds (buffers: never updated)
  for (std::size_t i = 0; i < all.size(); ++i) {
    const DatasetSpec& d = all[i];
    if (exec.partition().pipeline_stage(writers[i % params.size()]) != grid.stage()) continue;
    const ParamEntry* entry = nullptr;
    for (const ParamEntry& e : store.entries())
      if (!e.alias && e.owner_layer == d.layer && owner_spec(model, e).name == d.name)
        entry = &e;
    MPIPE_CHECK(entry, "no entry for ", d.path);
    const std::size_t which = i / params.size();  // 0 parameters, 1.. optimizer states
    const std::size_t numel = static_cast<std::size_t>(entry->numel());
    Mine m{i, nullptr, numel * sizeof(float)};
    int piece = 0;
    if (which == 0) {
      if (grid.replica() != 0) continue;
      m.data = source.params + entry->param_offset;
    } else if (!sharded) {
      m.data = source.states[which - 1] + entry->offset;
    } else if (const ShardPiece* p = optimizer.piece_of(static_cast<int>(entry - store.entries().data()))) {
      m.data = source.states[which - 1] + p->state_offset;
      m.bytes = p->count * sizeof(float);
      m.element = p->element;
      piece = optimizer.part();
    } else {
      // A view of no piece: a buffer (whose state stays zero), written whole by replica
      // 0, or a piece of fewer rows than replicas, empty here.
      if (!entry->buffer || grid.replica() != 0) continue;
      if (zeros.size() < numel) zeros.assign(numel, 0.0f);
      m.data = zeros.data();
    }
    m.crc = crc32_of(m.data, m.bytes);
    piece_crcs[i * static_cast<std::size_t>(parts) + static_cast<std::size_t>(piece)] = m.crc;
    piece_bytes[i * static_cast<std::size_t>(parts) + static_cast<std::size_t>(piece)] = static_cast<double>(m.bytes);
    mine.push_back(m);
  }
  comm.allreduce(std::span<unsigned>(piece_crcs), Reduce::max);
  if (parts > 1) comm.allreduce(std::span<double>(piece_bytes), Reduce::max);
  std::vector<unsigned> crcs(all.size(), 0);
  for (std::size_t i = 0; i < all.size(); ++i) {
    uLong crc = 0;  // of nothing; combined with each piece in row order
    for (std::size_t piece = 0; piece < static_cast<std::size_t>(parts); ++piece) {
      const std::size_t at = i * static_cast<std::size_t>(parts) + piece;
      if (parts == 1) crc = piece_crcs[at];
      else if (piece_bytes[at] > 0) crc = crc32_combine(crc, piece_crcs[at], static_cast<z_off_t>(piece_bytes[at]));
    }
    crcs[i] = static_cast<unsigned>(crc);
  }

  int direct_fd = -1;
  {
    const Hdf5Lock hdf5;  // a data reader's thread may use HDF5 meanwhile
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
        m.offset += m.element * sizeof(float);
        continue;
      }
      const Shape& shape = all[m.index].shape;
      if (m.bytes == static_cast<std::size_t>(shape.numel()) * sizeof(float)) {
        H5_CHECK(H5Dwrite(sets[m.index].get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, m.data), "cannot write ",
                 all[m.index].path, " (disk full?)");
        continue;
      }
      // A piece: whole rows of the dataset.
      std::vector<hsize_t> first(static_cast<std::size_t>(shape.rank), 0), count = dims(shape);
      const std::size_t row = static_cast<std::size_t>(shape.numel() / shape[0]);
      first[0] = m.element / row;
      count[0] = m.bytes / sizeof(float) / row;
      Handle file_space(H5Dget_space(sets[m.index].get()), H5Sclose);
      H5_CHECK(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, first.data(), nullptr, count.data(), nullptr),
               "cannot select rows of ", all[m.index].path);
      Handle memory_space(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), H5Sclose);
      H5_CHECK(H5Dwrite(sets[m.index].get(), H5T_NATIVE_FLOAT, memory_space.get(), file_space.get(), H5P_DEFAULT, m.data),
               "cannot write ", all[m.index].path, " (disk full?)");
    }
    sets.clear();
    // Training state and provenance, the same on every writer.
    TrainState state;
    state.step = step;
    state.updates = source.updates;
    state.samples = state.position = step * options.batch_size;
    state.seed = options.seed;
    state.data = options.data;
    state.run_id = dir.run_id();
    state.signature = model_signature(model);
    state.optimizer = options.optimizer.kind;
    state.config = dir.options().config_text;
    write_train_state(file.get(), state, model);
    if (dir.options().tokenizer) write_checkpoint_tokenizer(file.get(), *dir.options().tokenizer, comm.rank() == 0);
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
        if (bad.empty() && static_cast<uint32_t>(crc) != m.crc)
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

// ---- saving --------------------------------------------------------------------------

SaveResult save_checkpoint(Executor& exec, CheckpointDir& dir, std::int64_t step, Watchdog* liveness) {
  {
    const Hdf5Lock hdf5;  // the prefetch thread may be reading an HDF5 data file
    quiet_hdf5();
  }
  const Grid& grid = exec.grid();
  const Communicator& world = grid.world();
  const std::string final_path = checkpoint_path(dir.options().dir, step);
  // Every wait below is collective (MPI, HDF5's file create and close): a rank that
  // stopped answering must end the job, not leave the others waiting. Those stopped
  // before the checkpoint are named here; one that stops within it, by the watchdog's
  // heartbeats within --p2p-timeout, however large the file. Its deadline, which allows
  // a healthy write at 10 MB/s, bounds a write that every rank is still doing.
  const double timeout = exec.options().p2p_timeout;
  rendezvous(world, cat("checkpoint step ", step), timeout, liveness);
  std::optional<Watchdog> own;
  Watchdog& watchdog = liveness ? *liveness : own.emplace(world, grid.name(), timeout);
  const auto guard = watchdog.arm(cat("writing checkpoint ", final_path), write_deadline(exec));
  exec.download_state();  // on a GPU: the values and optimizer state to the host mirrors
  return commit_checkpoint(exec, dir, step, live_source(exec), world, grid.pipeline());
}

double write_deadline(const Executor& exec) {
  const double file_bytes = f32_bytes(static_cast<double>(exec.model().parameter_count())) *
                            static_cast<double>(1 + exec.optimizer().state_names().size());
  return exec.options().p2p_timeout + file_bytes / 10e6;
}

SaveSource live_source(Executor& exec) {
  SaveSource source{exec.params().params().data(), {}, exec.updates()};
  for (std::size_t s = 0; s < exec.optimizer().state_names().size(); ++s)
    source.states.push_back(exec.optimizer().state(static_cast<int>(s)).data());
  return source;
}

SaveResult commit_checkpoint(const Executor& exec, CheckpointDir& dir, std::int64_t step, const SaveSource& source,
                             const Communicator& world, const Communicator& pipeline) {
  auto seconds = [](auto from) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count(); };
  SaveResult result;
  const std::string& directory = dir.options().dir;
  const Grid& grid = exec.grid();
  const std::string final_path = checkpoint_path(directory, step);
  const std::string temp_path = (fs::path(directory) / ("." + fs::path(final_path).filename().string() + ".tmp")).string();
  const Model& model = exec.model();
  int failed = 0;
  std::string problem;

  WriteTimes times;
  // Replica 0 writes; with the optimizer sharded every replica writes its pieces.
  const bool writer = grid.replica() == 0 || exec.optimizer().sharded();
  if (writer) {
    try {
      times = write_file(exec, source, world, pipeline, temp_path, dir, step);
    } catch (const std::exception& e) {
      failed = 1;
      problem = e.what();
    }
  }
  // Agree before world rank 0 (a writer) verifies and renames; the slowest writer's
  // times are the checkpoint's.
  // (the last entry is 1 where some writer did not read its data back)
  double agreed[4] = {static_cast<double>(failed), times.write, times.read_back,
                      writer && !times.data_checked ? 1.0 : 0.0};
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
      // HDF5 from here to the pruning (the directory's files' run ids are read too).
      const Hdf5Lock hdf5;
      if (auto bad = verify_checkpoint(temp_path, &model, !data_checked))
        throw Error(cat("verification failed: ", *bad));
      dir.make_way(final_path);
      std::error_code ec;
      fs::rename(temp_path, final_path, ec);
      if (ec) throw Error(cat("cannot rename '", temp_path, "' to '", final_path, "': ", ec.message()));
      fsync_path(directory, true);
      result.verify_seconds = agreed[2] + seconds(verify_start);
      // Only now that the new one is in place: older files of this run beyond --keep,
      // and (--overwrite) the other run's.
      dir.after_save(final_path);
    } catch (const std::exception& e) {
      failed = 2;
      problem = e.what();
    }
  }
  // Never leave a partial file behind: removed before the others hear of the failure (a
  // rank that then ends the job first would have mpirun kill this one before it could).
  if (failed && world.rank() == 0) {
    std::error_code ec;
    fs::remove(temp_path, ec);
  }
  world.broadcast(std::span<int>(&failed, 1), 0);
  if (failed) {
    if (!problem.empty()) throw Error(cat("checkpoint ", final_path, ": ", problem));
    throw Error(cat("checkpoint ", final_path, " failed on another rank"));
  }
  result.path = final_path;
  return result;
}

// ---- resuming ----------------------------------------------------------------------

std::vector<std::string> resume_candidates(CheckpointDir& dir, const Model& model, const Communicator& world) {
  const CheckpointOptions& config = dir.options();
  // Rank 0 looks; the files' structure is checked here, their data as it is loaded.
  std::vector<std::string> chosen;
  std::string error;
  if (world.rank() == 0 && config.resume != "never") {
    if (config.resume != "auto") {
      if (auto bad = verify_checkpoint(config.resume, &model, false)) error = *bad;
      else chosen.push_back(config.resume);
    } else if (!config.dir.empty()) {
      for (const auto& entry : fs::directory_iterator(config.dir)) {
        const std::string name = entry.path().filename().string();
        const auto ends_with = [&](const char* tail) { return name.size() >= std::strlen(tail) && name.compare(name.size() - std::strlen(tail), std::string::npos, tail) == 0; };
        // A stray temporary from a run that died while writing, or the lock file MPI-IO
        // made beside it (.ckpt-N.h5.tmp-<job>.lock): the directory's lock says no other
        // job is writing one.
        if (name.rfind(".ckpt-", 0) == 0 && (ends_with(".tmp") || (name.find(".h5.tmp-") != std::string::npos && ends_with(".lock")))) {
          std::error_code ec;
          fs::remove(entry.path(), ec);
        }
      }
      for (const std::string& c : checkpoint_files(config.dir)) {
        if (auto bad = verify_checkpoint(c, &model, false)) {
          std::fprintf(stderr, "mpipe: warning: skipping checkpoint: %s\n", bad->c_str());
          dir.skipped(c);
        } else {
          chosen.push_back(c);
        }
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
  const CheckpointOptions& config = dir.options();
  const Communicator& world = exec.grid().world();
  const std::vector<std::string> candidates = resume_candidates(dir, exec.model(), world);
  std::string failures;
  for (const std::string& path : candidates) {
    try {
      std::string run_id;
      *step = load_checkpoint(exec, path, &run_id);
      if (!failures.empty() && world.rank() == 0) std::fflush(stdout);
      if (*step > exec.options().steps)
        throw Refused(cat("checkpoint '", path, "' is at step ", *step, ", beyond --steps ", exec.options().steps,
                          "; nothing to do"),
                      cat("give --steps more than ", *step, " to train on, or --resume never to start again"));
      if (const std::string refusal = dir.adopt_tokenizer(path, world, exec.options().data.starts_with("text:"));
          !refusal.empty())
        throw Refused(refusal, "give the checkpoint's tokenizer ('mpipe export' writes it out), or --resume never to start again");
      dir.adopt(run_id);
      return path;
    } catch (const Refused&) {
      throw;
    } catch (const UserError& e) {
      if (config.resume != "auto") throw UserError(cat("cannot resume: ", e.what()), e.hint());
      if (world.rank() == 0) {
        std::fprintf(stderr, "mpipe: warning: skipping checkpoint: %s\n", e.what());
        dir.skipped(path);
      }
      failures += cat(failures.empty() ? "" : "; ", path);
    }
  }
  // Parameters partly overwritten by a failed load must not be trained on.
  MPIPE_REQUIRE(failures.empty(), cat("move the damaged files away, or use --resume never"),
                "no checkpoint in '", config.dir, "' loads (", failures, ")");
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
    if (!state.optimizer.empty() && state.optimizer != exec.options().optimizer.kind) {
      other_optimizer = state.optimizer;
      throw Error("optimizer mismatch");
    }
    const Optimizer& optimizer = exec.optimizer();
    const auto names = optimizer.state_names();
    std::vector<float> rows;  // a row copy's owner, whole
    std::vector<float> view;  // a view's state, whole, of which a sharded optimizer keeps a piece
    const auto entries = store.entries();
    for (std::size_t index = 0; index < entries.size(); ++index) {
      const ParamEntry& e = entries[index];
      if (e.alias) continue;  // the owner's values, loaded with the owner
      // A tied copy on another stage loads the owner's values and state.
      auto read = [&](const std::string& root, float* out) {
        if (auto p = read_entry(file.get(), exec.model(), e, root, out, rows)) throw Error(cat("'", path, "': ", *p));
      };
      read("/model", store.params().data() + e.param_offset);
      if (state.optimizer.empty()) continue;
      // Every view's whole state is read (its checksum is of the whole), whatever piece
      // of it this rank keeps: a checkpoint loads onto any D, sharded or not.
      const ShardPiece* piece = optimizer.sharded() ? optimizer.piece_of(static_cast<int>(index)) : nullptr;
      if (optimizer.sharded() && !piece) continue;  // none here (a buffer: never updated)
      for (std::size_t s = 0; s < names.size(); ++s) {
        const std::span<float> into = optimizer.state(static_cast<int>(s));
        if (!piece) {
          read("/optimizer/" + names[s], into.data() + e.offset);
          continue;
        }
        view.resize(static_cast<std::size_t>(e.numel()));
        read("/optimizer/" + names[s], view.data());
        std::copy_n(view.begin() + static_cast<std::ptrdiff_t>(piece->element), piece->count, into.begin() + static_cast<std::ptrdiff_t>(piece->state_offset));
      }
    }
  } catch (const std::exception& e) {
    problem = e.what();
  }
  int failed = problem.empty() ? 0 : 1;
  const Communicator& world = exec.grid().world();
  world.allreduce(std::span<int>(&failed, 1), Reduce::max);
  if (!other_optimizer.empty())  // every rank reads the same attribute
    throw Refused(cat("checkpoint '", path, "' holds ", other_optimizer, " optimizer state; this run uses --optimizer ",
                      exec.options().optimizer.kind),
                  cat("use --optimizer ", other_optimizer, " to continue it, or --resume never to start again"));
  if (failed) throw UserError(problem.empty() ? cat("'", path, "': failed on another rank") : problem,
                              "check the file with 'mpipe inspect --verify'");
  exec.set_updates(state.updates);
  exec.upload_state();  // on a GPU: the loaded values and state into device memory
  if (run_id) *run_id = state.run_id;
  return state.step;
}

}  // namespace mpipe
