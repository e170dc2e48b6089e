// `mpipe generate`: a GPT checkpoint's continuation of a prompt.
//
// Each rank holds a contiguous range of the layers (generation_stages): the first embeds
// the tokens and prints, the last computes the logits and samples. A sequence's step is
// one forward down the ranks, then its token back to the first rank: with several
// samples in flight the ranks work on different ones at once. With one rank it is all
// local. Messages: a header (sequence, position, tokens, stop) and the activations (1, t,
// C) down the chain; (sequence, token) from the last rank to the first.
#include "mpipe/app/generate.hpp"

#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>

#include "mpipe/app/output.hpp"
#include "mpipe/app/process.hpp"
#include "mpipe/app/tokenize.hpp"
#include "mpipe/app/startup.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/io/checkpoint_format.hpp"
#include "mpipe/io/checkpoint_tokenizer.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/pipeline/comm/hosts.hpp"
#include "mpipe/pipeline/comm/watchdog.hpp"
#include "mpipe/text/tokenizer.hpp"

namespace mpipe {

namespace {

constexpr int tag_forward = 101, tag_token = 102;

struct Header {
  std::int64_t sequence = 0, position = 0, count = 0, stop = 0;
};
struct Drawn {
  std::int64_t sequence = 0, token = 0;
};

// What a rank holds: the checkpoint's model, its layers' parameters and their decoder.
struct Loaded {
  CheckpointToRead source;
  std::vector<int> stages;
  std::unique_ptr<ParamStore> store;
  std::unique_ptr<Decoder> decoder;
  std::vector<std::int32_t> prompt;  // the first rank's
  bool text = false;
  std::unique_ptr<Tokenizer> tokenizer;  // the first rank's: --tokenizer's, or the checkpoint's
  // Ids the last rank draws from: the tokenizer's, which may be fewer than the model's
  // padded vocabulary (an id past them decodes to nothing); 0: all of the model's.
  std::int64_t drawable = 0;
};

std::vector<std::int32_t> read_token_file(const std::string& path, std::int64_t vocab) {
  // Only a regular file: a directory reads as an error of the stream's, a FIFO may block.
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  MPIPE_REQUIRE(std::filesystem::exists(status), "give a file of little-endian uint16 token ids", "--prompt-tokens: no file '",
                path, "'");
  MPIPE_REQUIRE(std::filesystem::is_regular_file(status), "give a file of little-endian uint16 token ids", "--prompt-tokens '",
                path, "' is ", std::filesystem::is_directory(status) ? "a directory" : "not a regular file");
  std::ifstream in(path, std::ios::binary);
  MPIPE_REQUIRE(in.good(), "give a file of little-endian uint16 token ids", "cannot read --prompt-tokens '", path, "'");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  MPIPE_REQUIRE(!bytes.empty() && bytes.size() % 2 == 0, "give a file of little-endian uint16 token ids",
                "--prompt-tokens '", path, "' holds ", bytes.size(), " bytes, not a whole number of uint16 ids (at least one)");
  std::vector<std::int32_t> ids(bytes.size() / 2);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<unsigned char>(bytes[2 * i]) | (static_cast<unsigned char>(bytes[2 * i + 1]) << 8);
    MPIPE_REQUIRE(ids[i] < vocab, "give ids of the model's vocabulary", "--prompt-tokens '", path, "': id ", ids[i],
                  " at position ", i, " is not below the vocabulary's ", vocab);
  }
  return ids;
}

// The prompt's tokens, and whether the output is text (the tokens' bytes).
// `tokenizer_source` names the tokenizer in errors: --tokenizer's file, or the checkpoint's.
std::vector<std::int32_t> prompt_tokens(const GenerateOptions& o, std::int64_t vocab, bool& text, const Tokenizer* tokenizer,
                                        const std::string& tokenizer_source) {
  if (tokenizer) {  // words in and out, unless --output ids
    require_tokenizer_fits(*tokenizer, tokenizer_source, vocab);
    text = o.output != "ids";
    if (!o.prompt_tokens.empty()) return read_token_file(o.prompt_tokens, vocab);
    std::vector<std::int32_t> ids = tokenizer->encode(o.prompt_given ? o.prompt : "\n");
    MPIPE_REQUIRE(!ids.empty(), "give a prompt of at least one token", "--prompt is empty");
    return ids;
  }
  text = o.output == "text" || (o.output == "auto" && vocab <= 256 && o.prompt_tokens.empty());
  MPIPE_REQUIRE(!text || vocab <= 256, "use --output ids", "--output text prints tokens as bytes, and the model's ",
                vocab, " tokens are more than bytes");
  if (!o.prompt_tokens.empty()) return read_token_file(o.prompt_tokens, vocab);
  MPIPE_REQUIRE(o.prompt_given || vocab <= 256, "give --prompt-tokens FILE", "a vocabulary of ", vocab,
                " tokens has no default prompt");
  const std::string prompt = o.prompt_given ? o.prompt : "\n";
  MPIPE_REQUIRE(!prompt.empty(), "give a prompt of at least one byte", "--prompt is empty");
  std::vector<std::int32_t> ids;
  for (const char c : prompt) {
    const auto id = static_cast<std::int32_t>(static_cast<unsigned char>(c));
    MPIPE_REQUIRE(id < vocab, "give a prompt of the model's tokens", "--prompt byte ", id, " is not below the vocabulary's ",
                  vocab);
    ids.push_back(id);
  }
  return ids;
}

// `checkpoint`: the option on rank 0, which picks and verifies the file; the file it
// picked on the others, which read it unverified (once is enough).
std::unique_ptr<Loaded> load(const GenerateOptions& o, const std::string& checkpoint, const Communicator& world,
                             Device device, DType dtype) {
  auto l = std::make_unique<Loaded>(
      Loaded{open_checkpoint_to_read(checkpoint, "generate from", world.rank() == 0), {}, {}, {}, {}, false});
  Model& model = l->source.model;
  MPIPE_REQUIRE(device == Device::cpu || model.tokens() <= cuda::kMaxDecodeKeys, "generate on the CPU (--device cpu)",
                "the GPU's generation takes a context of up to ", cuda::kMaxDecodeKeys, " tokens, and the model's is ",
                model.tokens());
  if (const std::string problem = generation_problem(model); !problem.empty())
    throw UserError(cat("'", l->source.path, "' cannot generate: ", problem), "generate from a GPT checkpoint");
  l->stages = generation_stages(model, world.size());
  const int begin = l->stages[static_cast<std::size_t>(world.rank())], end = l->stages[static_cast<std::size_t>(world.rank()) + 1];
  l->store = std::make_unique<ParamStore>(model, begin, end, 0);
  std::vector<float> rows;
  for (const ParamEntry& e : l->store->entries()) {
    if (e.alias) continue;  // the owner's values
    if (auto bad = read_entry(l->source.file.get(), model, e, "/model", l->store->params().data() + e.param_offset, rows))
      throw UserError(cat("'", l->source.path, "': ", *bad), "generate from an older checkpoint");
  }
  if (device == Device::cuda) l->store->to_device(dtype);
  l->decoder = std::make_unique<Decoder>(model, begin, end, o.samples, device, dtype);
  if (world.rank() == 0) {
    // --tokenizer wins; else the one the checkpoint keeps (train --tokenizer), if any.
    std::string source = o.tokenizer;
    if (!o.tokenizer.empty()) {
      l->tokenizer = load_tokenizer(o.tokenizer);
    } else {
      std::string problem;
      if (std::optional<TokenizerFile> kept = read_checkpoint_tokenizer(l->source.file.get(), &problem)) {
        source = cat(l->source.path, ":", checkpoint_tokenizer_path, " (", kept->name, ")");
        l->tokenizer = tokenizer_from_bytes(kept->bytes, source);
      }
      MPIPE_REQUIRE(problem.empty(), "generate from an older checkpoint, or give --tokenizer", "'", l->source.path, "': ",
                    problem);
    }
    l->prompt = prompt_tokens(o, l->decoder->vocab(), l->text, l->tokenizer.get(), source);
  }
  return l;
}

void send(const Communicator& world, std::span<const std::byte> bytes, int to, int tag) {
  MPI_CHECK(MPI_Send(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, to, tag, world.get()));
}
void receive(const Communicator& world, std::span<std::byte> bytes, int from, int tag) {
  MPI_CHECK(MPI_Recv(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, from, tag, world.get(), MPI_STATUS_IGNORE));
}
template <class T>
std::span<std::byte> bytes_of(T& value) {
  return {reinterpret_cast<std::byte*>(&value), sizeof(T)};
}

// The activations' bytes on the host (sent from, received into), as large as the most a
// message holds.
struct HostBuffer {
  std::vector<std::byte> bytes;
  Tensor of(const Tensor& like) {
    bytes.resize(std::max(bytes.size(), like.bytes()));
    return Tensor{bytes.data(), like.shape, like.dtype, Device::cpu};
  }
};

class Run {
 public:
  Run(const GenerateOptions& o, const Communicator& world, Loaded& l)
      : o_(o), world_(world), l_(l), d_(*l.decoder), first_(world.rank() == 0), last_(world.rank() == world.size() - 1) {}

  // The first rank: every sample's tokens to the end, printed; the others: forwards until
  // told to stop. Returns the exit code: standard output that failed (a full disk, its
  // reader gone) ends the generation at once, the forwards in flight drained, with its line.
  int operator()() {
    if (!first_) {
      serve();
      return 0;
    }
    const auto start = std::chrono::steady_clock::now();
    auto checked = start;
    sequences_.assign(static_cast<std::size_t>(o_.samples), Sequence{l_.prompt, 0});
    if (o_.samples == 1) print_tokens(l_.prompt, true);
    for (int s = 0; s < o_.samples; ++s) feed(s);
    for (int active = o_.samples; active > 0;) {
      Drawn drawn;
      if (last_) {
        drawn = local_.front();
        local_.pop_front();
      } else {
        receive(world_, bytes_of(drawn), world_.size() - 1, tag_token);
      }
      Sequence& q = sequences_[static_cast<std::size_t>(drawn.sequence)];
      if (output_error_.empty()) {
        q.tokens.push_back(static_cast<std::int32_t>(drawn.token));
        if (o_.samples == 1) print_tokens({q.tokens.end() - 1, q.tokens.end()}, false);
        // Whatever SIGPIPE's disposition, and with nothing printed yet (several samples, or
        // under mpirun, whose own writes fail): a reader gone ends the run.
        if (const auto now = std::chrono::steady_clock::now(); now - checked > std::chrono::milliseconds(200)) {
          checked = now;
          check_output();
        }
      }
      // Each active sequence has one forward in flight: after a failure, each comes back.
      if (!output_error_.empty() || ++q.generated == o_.tokens) {
        --active;
        continue;
      }
      feed(static_cast<int>(drawn.sequence));
    }
    if (world_.size() > 1) {
      Header stop{0, 0, 0, 1};
      send(world_, bytes_of(stop), 1, tag_forward);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!output_error_.empty()) {
      std::fprintf(stderr, "%s\n", output_error_.c_str());
      return output_code_;
    }
    if (o_.samples == 1) {
      if (stream_) std::fputs(stream_->finish().c_str(), stdout);
      // The status line goes to standard error after it: the text ends its own line.
      const std::vector<std::int32_t>& text = sequences_.front().tokens;
      const bool ends_line =
          l_.text && !text.empty() &&
          (l_.tokenizer ? l_.tokenizer->decode(std::span(&text.back(), 1)).ends_with('\n') : text.back() == '\n');
      if (!ends_line) std::fputc('\n', stdout);
    } else {
      for (int s = 0; s < o_.samples; ++s) {
        std::printf("== sample %d ==\n", s + 1);
        print_tokens(sequences_[static_cast<std::size_t>(s)].tokens, true);
        std::fputc('\n', stdout);
      }
    }
    check_output();
    if (!output_error_.empty()) {
      std::fprintf(stderr, "%s\n", output_error_.c_str());
      return output_code_;
    }
    const double made = static_cast<double>(o_.tokens) * o_.samples;
    std::fprintf(stderr,
                 "mpipe: generated %.0f tokens (%d sample%s of %lld after a prompt of %zu) in %.3f s: %.1f tokens/s on %d "
                 "rank%s\n",
                 made, o_.samples, o_.samples == 1 ? "" : "s", static_cast<long long>(o_.tokens), l_.prompt.size(), seconds,
                 made / seconds, world_.size(), world_.size() == 1 ? "" : "s");
    return 0;
  }

 private:
  struct Sequence {
    std::vector<std::int32_t> tokens;
    std::int64_t generated = 0;
  };

  // The next forward of sequence s (Decoder::next_feed says which tokens).
  void feed(int s) {
    Sequence& q = sequences_[static_cast<std::size_t>(s)];
    const std::int64_t size = static_cast<std::int64_t>(q.tokens.size());
    const auto [count, position] = d_.next_feed(s, size, q.generated == 0);
    const Tensor host = make_tensor(q.tokens.data() + (size - count), Shape{1, count});
    const Tensor x = d_.input(count);
    ops::transfer(x, host);
    forward(s, x, position);
  }

  // A forward of this rank's layers, then on: to the next rank, or the drawn token (to
  // the first rank, or kept here when this is the first).
  void forward(int s, const Tensor& x, std::int64_t position) {
    const Tensor y = d_.forward(s, x, position);
    if (!last_) {
      Header h{s, position, x.shape[1], 0};
      send(world_, bytes_of(h), world_.rank() + 1, tag_forward);
      const Tensor out = host_.of(y);
      ops::transfer(out, y);
      send(world_, out.byte_span(), world_.rank() + 1, tag_forward);
      return;
    }
    std::int64_t& drawn = drawn_[static_cast<std::size_t>(s)];
    std::span<const float> logits = y.span();  // (V)
    if (l_.drawable > 0) logits = logits.first(static_cast<std::size_t>(l_.drawable));
    const std::int32_t token = sample_token(logits, o_.sampling, sampling_uniform(o_.seed, s, drawn++), order_, weights_);
    if (first_) {
      local_.push_back({s, token});
      return;
    }
    // Not a blocking send: the messages go round (first rank, ..., last, first), and a
    // send that waited for its receive could close the circle.
    tokens_out_.push_back({{s, token}, MPI_REQUEST_NULL});
    Outgoing& out = tokens_out_.back();
    MPI_CHECK(MPI_Isend(&out.drawn, static_cast<int>(sizeof(Drawn)), MPI_BYTE, 0, tag_token, world_.get(), &out.request));
    while (!tokens_out_.empty()) {  // the sent ones' memory back
      int done = 0;
      MPI_CHECK(MPI_Test(&tokens_out_.front().request, &done, MPI_STATUS_IGNORE));
      if (!done) break;
      tokens_out_.pop_front();
    }
  }

  // A rank after the first: the forwards the rank before sends, until it says stop.
  void serve() {
    for (;;) {
      Header h;
      receive(world_, bytes_of(h), world_.rank() - 1, tag_forward);
      if (h.stop) {
        if (!last_) send(world_, bytes_of(h), world_.rank() + 1, tag_forward);
        for (Outgoing& out : tokens_out_) MPI_CHECK(MPI_Wait(&out.request, MPI_STATUS_IGNORE));
        return;
      }
      const Tensor x = d_.input(h.count);
      const Tensor in = host_.of(x);
      receive(world_, in.byte_span(), world_.rank() - 1, tag_forward);
      ops::transfer(x, in);
      forward(static_cast<int>(h.sequence), x, h.position);
    }
  }

  void print_tokens(std::span<const std::int32_t> tokens, bool from_start) {
    if (l_.text && l_.tokenizer) {  // decoded: one sample's stream whole characters at a time, a sample's whole text
      if (o_.samples == 1) {
        if (!stream_) stream_ = std::make_unique<StreamDecoder>(*l_.tokenizer);
        for (const std::int32_t id : tokens) std::fputs(stream_->put(id).c_str(), stdout);
      } else {
        std::fputs(l_.tokenizer->decode(tokens).c_str(), stdout);
      }
      if (output_error_.empty()) stdout_failed(&output_error_, &output_code_);
      return;
    }
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (l_.text) std::fputc(tokens[i], stdout);
      else std::printf(i == 0 && from_start ? "%d" : " %d", tokens[i]);
    }
    if (output_error_.empty()) stdout_failed(&output_error_, &output_code_);
  }

  void check_output() {
    if (output_error_.empty()) stdout_failed(&output_error_, &output_code_, /*readers=*/true);
  }

  const GenerateOptions& o_;
  const Communicator& world_;
  Loaded& l_;
  Decoder& d_;
  bool first_, last_;
  std::vector<Sequence> sequences_;
  std::vector<std::int64_t> drawn_ = std::vector<std::int64_t>(static_cast<std::size_t>(o_.samples), 0);
  std::deque<Drawn> local_;
  struct Outgoing {
    Drawn drawn;
    MPI_Request request;
  };
  std::deque<Outgoing> tokens_out_;  // the last rank's tokens in flight (a deque: they stay put)
  HostBuffer host_;
  std::string output_error_;  // standard output's failure, said once the forwards in flight are back
  int output_code_ = 0;
  std::vector<std::int32_t> order_;
  std::vector<double> weights_;
  std::unique_ptr<StreamDecoder> stream_;  // --tokenizer, one sample
};

}  // namespace

void validate(const GenerateOptions& o) {
  const std::string hint = "see mpipe generate --help";
  MPIPE_REQUIRE(!o.checkpoint.empty(), "give --checkpoint PATH (a ckpt-*.h5 file or a run's --checkpoint-dir)",
                "--checkpoint is required");
  MPIPE_REQUIRE(o.tokens >= 1 && o.tokens <= 1000000000, hint, "--tokens must be from 1 to 1e9, got ", o.tokens);
  MPIPE_REQUIRE(o.samples >= 1 && o.samples <= 4096, hint, "--samples must be from 1 to 4096, got ", o.samples);
  MPIPE_REQUIRE(std::isfinite(o.sampling.temperature) && o.sampling.temperature >= 0, "give 0 (greedy) or more",
                "--temperature must be a number from 0, got ", o.sampling.temperature);
  MPIPE_REQUIRE(o.sampling.top_k >= 0, "give 0 (all tokens) or more", "--top-k must be from 0, got ", o.sampling.top_k);
  MPIPE_REQUIRE(o.sampling.top_p > 0 && o.sampling.top_p <= 1, "give a probability in (0, 1]", "--top-p must be in (0, 1], got ",
                o.sampling.top_p);
  MPIPE_REQUIRE(o.output == "auto" || o.output == "text" || o.output == "ids", "use auto, text or ids",
                "--output must be auto, text or ids, got '", o.output, "'");
  MPIPE_REQUIRE(!o.prompt_given || o.prompt_tokens.empty(), "give one of them", "--prompt and --prompt-tokens both given");
  MPIPE_REQUIRE(o.threads >= 0, hint, "--threads must be from 0, got ", o.threads);
  MPIPE_REQUIRE(std::isfinite(o.p2p_timeout) && o.p2p_timeout > 0, "e.g. --p2p-timeout 600",
                "--p2p-timeout must be positive, got ", o.p2p_timeout);
  MPIPE_REQUIRE(o.device == "cpu" || o.device == "cuda" || o.device == "auto", "use cpu, cuda or auto",
                "--device must be cpu, cuda or auto, got '", o.device, "'");
  MPIPE_REQUIRE(o.precision == "fp32" || o.precision == "bf16", "use fp32, or bf16 on a GPU",
                "--precision must be fp32 or bf16, got '", o.precision, "'");
}

int run_generate(const GenerateOptions& o, const Communicator& world) {
  validate(o);
  TrainConfig device_config;  // the device and precision, resolved as training resolves them
  device_config.device = o.device;
  device_config.precision = o.precision;
  resolve_device(device_config, world);
  cpu::set_threads(rank_threads(o.threads, world));
  const Device device = device_config.device == "cuda" ? Device::cuda : Device::cpu;
  const DType dtype = device_config.precision == "bf16" ? DType::bf16 : DType::f32;
  // As in train: heartbeats from here to the end, so that a rank stopped while the others
  // wait for it in a blocking call (the load's collectives, a token's messages) is named
  // within --p2p-timeout and the job ends. The hosts first: the line names the rank's node.
  learn_hosts(world);
  Watchdog watchdog(world, rank_on_host(world.rank()), o.p2p_timeout);
  disarm_startup_deadline();  // the watchdog names a stopped rank from here on
  Watchdog::Guard guard = watchdog.arm("loading the checkpoint", std::numeric_limits<double>::infinity());
  // Every rank loads its layers; the lowest rank with a problem says it, once.
  // Rank 0 first: it picks the checkpoint (a directory's newest that verifies) and checks
  // it; the others then read the same file.
  std::unique_ptr<Loaded> loaded;
  std::string problem, path;
  int code = 0;
  auto load_here = [&](const std::string& checkpoint) {
    try {
      loaded = load(o, checkpoint, world, device, dtype);
    } catch (const UserError& e) {
      problem = cat(e.what(), "; hint: ", e.hint());
      code = exit_user_error;
    } catch (const std::exception& e) {
      problem = e.what();
      code = exit_internal_error;
    }
  };
  if (world.rank() == 0) {
    load_here(o.checkpoint);
    if (loaded) path = loaded->source.path;
  }
  world.broadcast(path, 0);
  if (world.rank() != 0 && !path.empty()) load_here(path);
  int first = code != 0 ? world.rank() : world.size();
  world.allreduce(std::span<int>(&first, 1), Reduce::min);
  if (first < world.size()) {
    if (world.rank() == first) std::fprintf(stderr, "mpipe: error: %s\n", problem.c_str());
    world.broadcast(std::span<int>(&code, 1), first);
    return code;
  }
  // (a tokenizer's vocabulary fits an int: ids are int32)
  int drawable = world.rank() == 0 && loaded->tokenizer ? static_cast<int>(loaded->tokenizer->vocab_size()) : 0;
  world.broadcast(std::span<int>(&drawable, 1), 0);
  loaded->drawable = drawable;
  if (world.rank() == 0) {
    const Loaded& l = *loaded;
    std::fprintf(stderr, "mpipe: generating from %s (step %lld), layers", l.source.path.c_str(),
                 static_cast<long long>(l.source.step));
    for (std::size_t r = 0; r + 1 < l.stages.size(); ++r) std::fprintf(stderr, " %d-%d", l.stages[r], l.stages[r + 1] - 1);
    std::fprintf(stderr, " on %d rank%s, %s\n", world.size(), world.size() == 1 ? "" : "s", device_config.device.c_str());
  }
  watchdog.doing("generating");
  try {
    code = Run(o, world, *loaded)();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "mpipe: error on rank %d: %s\n", world.rank(), e.what());
    std::fflush(stderr);
    if (world.size() > 1) MPI_Abort(world.get(), exit_internal_error);
    return exit_internal_error;
  }
  // Every rank's work is done: a rank stopped now is named, not waited for; then every
  // rank ends with rank 0's code (its standard output may have failed).
  guard.reset();
  rendezvous(world, "the end of generation", o.p2p_timeout, &watchdog);
  world.broadcast(std::span<int>(&code, 1), 0);
  return code;
}

}  // namespace mpipe
