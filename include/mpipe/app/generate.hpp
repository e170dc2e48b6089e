// `mpipe generate`: text (or token ids) from a GPT checkpoint, on one process or split
// over the job's ranks by layers (nn/decoder.hpp).
#pragma once
#include <cstdint>
#include <string>

#include "mpipe/nn/decoder.hpp"
#include "mpipe/pipeline/comm/comm.hpp"

namespace mpipe {

struct GenerateOptions {
  std::string checkpoint;     // a file, or a run's --checkpoint-dir (its newest that verifies)
  std::string prompt;         // bytes, for a vocabulary of bytes
  bool prompt_given = false;  // --prompt was given (an empty one included)
  std::string prompt_tokens;  // a file of little-endian uint16 ids
  std::string tokenizer;      // a tokenizer file (text/tokenizer.hpp): the prompt encoded, the output decoded
  std::int64_t tokens = 128;  // to generate per sample
  int samples = 1;            // continuations of the prompt (in flight together across ranks)
  Sampling sampling;
  std::uint64_t seed = 1;
  std::string output = "auto";  // text (the bytes), ids, or auto: text for a vocabulary of bytes given --prompt
  std::string device = "cpu";   // cpu, cuda or auto
  std::string precision = "fp32";
  // Per rank; 0: the cores given to the rank. One by default: a token's work is small, and
  // on 2 cores beside other work 2 threads made it 60 times slower (OpenMP's and
  // OpenBLAS's threads waiting on each other).
  int threads = 1;
  double p2p_timeout = 600;  // seconds a rank may be silent before the job ends naming it
};

// Checks the options alone; UserError naming the first problem.
void validate(const GenerateOptions& options);
// Collective over `world`: every rank loads its layers; an error on any rank is said
// once (by the lowest rank that has it) and ends every rank with the same exit code; a rank
// that stops answering is named within --p2p-timeout (the watchdog's heartbeats, as in
// train) and the job ends; standard output that fails ends it with exit 1 (app/output.hpp).
int run_generate(const GenerateOptions& options, const Communicator& world);

}  // namespace mpipe
