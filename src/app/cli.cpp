// The command line: the options of train and plan, the subcommands, and the error
// policy of parsing (one line on rank 0, exit 2).
#include "mpipe/app/cli.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "mpipe/app/config_file.hpp"
#include "mpipe/app/export.hpp"
#include "mpipe/app/generate.hpp"
#include "mpipe/app/inspect.hpp"
#include "mpipe/app/plan.hpp"
#include "mpipe/app/process.hpp"
#include "mpipe/app/startup.hpp"
#include "mpipe/app/tokenize.hpp"
#include "mpipe/pipeline/comm/progress.hpp"
#include "mpipe/app/train.hpp"
#include "mpipe/core/version.hpp"
#include "mpipe/nn/registry.hpp"

namespace mpipe {

namespace {
// --seed: digits from 0 to 2^64-1 (CLI11 would take -1 or 2^64 and wrap them).
CLI::Validator seed_check() {
  return CLI::Validator(
      [](std::string& text) {
        const std::size_t start = std::min(text.find_first_not_of('0'), text.size() - (text.empty() ? 0 : 1));
        const std::string digits = text.substr(start);
        const bool number = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
        const bool fits = digits.size() < 20 || (digits.size() == 20 && digits <= "18446744073709551615");
        return number && fits ? std::string() : "must be an integer from 0 to 2^64-1, got " + text;
      },
      "SEED");
}

// Edits (insert, delete, replace) from one word to another: the distance "did you mean" ranks by.
std::size_t edit_distance(const std::string& from, const std::string& to) {
  std::vector<std::size_t> row(to.size() + 1);
  for (std::size_t j = 0; j <= to.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= from.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= to.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (from[i - 1] == to[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[to.size()];
}

// For an unknown option typed to a command: "did you mean --micro-batches? ", naming the
// command's option nearest to the first --word it does not know; empty when none is near.
std::string did_you_mean(const CLI::App& command, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.rfind("--", 0) != 0 || word.size() < 3) continue;
    const std::string typed = word.substr(0, word.find('='));
    if (command.get_option_no_throw(typed) != nullptr) continue;
    // In half edits: at most a third of the word's letters (2 at least) may differ, and a
    // word that begins a known option (--micro) counts one and a half, so that a typo
    // (--rank for --ranks) wins over a longer option it begins (--rank-order).
    std::string best;
    std::size_t best_score = 2 * std::max<std::size_t>(2, typed.size() / 3) + 1;
    for (const CLI::Option* option : command.get_options()) {
      for (const std::string& name : option->get_lnames()) {
        const std::string known = "--" + name;
        std::size_t score = 2 * edit_distance(typed, known);
        if (known.rfind(typed, 0) == 0) score = std::min<std::size_t>(score, 3);
        if (score < best_score) best = known, best_score = score;
      }
    }
    return best.empty() ? std::string() : "did you mean " + best + "? ";
  }
  return {};
}

// Each command's --help ends with a few lines to copy (docs/README.md is the manual).
constexpr const char* kAppExamples =
    "\nExamples (as root, first: export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1):\n"
    "  mpipe train --config inputs/quickstart.toml\n"
    "  mpirun -n 4 --oversubscribe mpipe train --config inputs/quickstart.toml --micro-batches 8 --schedule 1f1b\n"
    "  mpipe plan --config inputs/quickstart.toml --ranks 4 --micro-batches 8\n"
    "Manual: docs/README.md\n";
constexpr const char* kTrainExamples =
    "\nExamples:\n"
    "  mpipe train --config inputs/quickstart.toml --steps 100\n"
    "  mpirun -n 4 --oversubscribe mpipe train --config inputs/quickstart.toml --stages 2 --replicas 2 --remat always\n"
    "  mpipe train --config inputs/quickstart.toml --data text:README.md --checkpoint-dir runs/text";
constexpr const char* kPlanExamples =
    "\nExamples:\n"
    "  mpipe plan --config inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule 1f1b\n"
    "  mpipe plan --model resnet --layers 50 --image 224 --classes 1000 --ranks 8 --micro-batches 32 --batch-size 256\n"
    "  mpipe plan --model gpt --layers 12 --print-model > runs/gpt12.toml";
constexpr const char* kInspectExamples =
    "\nExamples:\n"
    "  mpipe inspect runs/ckpt/ckpt-00000100.h5 --stats --verify\n"
    "  mpipe inspect runs/ckpt/ckpt-00000100.h5 --config > runs/run.toml";
constexpr const char* kExportExamples =
    "\nExamples:\n"
    "  mpipe export runs/ckpt runs/model.safetensors\n"
    "  mpipe export runs/ckpt runs/hf/     # model.safetensors and config.json";
constexpr const char* kGenerateExamples =
    "\nExamples:\n"
    "  mpipe generate --checkpoint runs/text --prompt \"Each MPI rank\" --tokens 200 --top-k 40\n"
    "  mpipe generate --checkpoint runs/text --prompt \"The\" --temperature 0\n"
    "  mpirun -n 2 mpipe generate --checkpoint runs/text --prompt \"The\" --samples 4";
constexpr const char* kTokenizeExamples =
    "\nExamples:\n"
    "  scripts/train_tokenizer.sh README.md docs/*.md --vocab 2000 --out runs/tok\n"
    "  mpipe tokenize --tokenizer runs/tok/tokenizer.model corpus/*.txt --out runs/shards\n"
    "  mpipe train --data 'tokens:runs/shards/*.bin' --vocab 2000 --data-packing documents";
}  // namespace

void add_train_options(CLI::App& cmd, TrainConfig& c) {
  c.device = "auto";  // the library default is the CPU; users get the GPU when there is one
  // An option given twice takes the last value, so scripts can append overrides.
  cmd.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd.add_option("--config", c.config_file, "TOML file with any of these options (command-line values win)")
      ->check(CLI::ExistingFile);
  auto& m = c.model;
  auto& o = c.optimizer;
  auto& p = c.pipeline;
  cmd.add_option("--model", m.kind, "Model: a preset (gpt, llama, mlp or resnet, sized by the options below) or a model file (TOML: see plan --print-model and --layer-kinds)")->capture_default_str();
  cmd.add_option("--layers", m.layers, "Transformer blocks (gpt, llama), hidden blocks (mlp) or depth (resnet: 18, 34, 50, 101 or 152; default 18)")->capture_default_str();
  cmd.add_option("--d-model", m.d_model, "Channels of the residual stream (gpt, llama)")->capture_default_str();
  cmd.add_option("--heads", m.heads, "Attention heads (gpt, llama)")->capture_default_str();
  cmd.add_option("--kv-heads", m.kv_heads, "Key/value heads, dividing --heads (llama; grouped-query attention, 1: multi-query, 0: as --heads)")->capture_default_str();
  cmd.add_option("--ffn", m.ffn, "Width of the SwiGLU MLP (llama; 0: Llama's rule, 8/3 --d-model rounded up to 256)")->capture_default_str();
  cmd.add_option("--rope-theta", m.rope_theta, "RoPE's base (llama; Llama 2 10000, Llama 3 500000)")->capture_default_str();
  cmd.add_option("--norm-eps", m.norm_eps, "RMSNorm's eps (llama)")->capture_default_str();
  cmd.add_option("--tie-embeddings", m.tie_embeddings, "The LM head is the token table, on or off (llama; gpt always ties)")->capture_default_str();
  cmd.add_option("--seq-len", m.seq_len, "Tokens per sample (gpt, llama)")->capture_default_str();
  cmd.add_option("--vocab", m.vocab, "Vocabulary size (gpt, llama)")->capture_default_str();
  cmd.add_option("--head-chunks", m.head_chunks,
                 "The LM head as this many vocabulary chunks, layers a pipeline can put on different stages "
                 "(gpt, llama; 1: one linear layer)")->capture_default_str();
  cmd.add_option("--head-logits", m.head_logits,
                 "With --head-chunks: keep each chunk's logits for the backward (keep), or compute them again there "
                 "(recompute: one more GEMM a chunk, no batch x tokens x vocabulary logits held)")->capture_default_str();
  cmd.add_option("--hidden", m.hidden, "Width of the hidden layers (mlp)")->capture_default_str();
  cmd.add_option("--inputs", m.inputs, "Input features (mlp)")->capture_default_str();
  cmd.add_option("--classes", m.classes, "Output classes (mlp, resnet)")->capture_default_str();
  cmd.add_option("--image", m.image, "Input side in pixels (resnet; from 128 on ImageNet's 7x7/2 stem and max pool)")->capture_default_str();
  cmd.add_option("--channels", m.channels, "Input channels (resnet)")->capture_default_str();
  cmd.add_option("--width", m.width, "Channels of the first of the four stages (resnet)")->capture_default_str();
  cmd.add_option("--dropout", m.dropout, "Dropout probability")->capture_default_str();
  cmd.add_option("--data", c.data,
                 "synthetic, text:PATH (bytes), tokens:PATH (an llm.c shard, a directory or glob of them, or flat uint16 ids) or "
                 "hdf5:PATH (/inputs and /labels; docs/data.md)")
      ->capture_default_str();
  cmd.add_option("--tokenizer", c.tokenizer,
                 "A tokenizer file (SentencePiece tokenizer.model or Hugging Face BPE tokenizer.json; docs/tokenizers.md) "
                 "that turns --data text:PATH into token ids; kept in each checkpoint, which generate and export then use");
  cmd.add_option("--batch-size", c.batch_size, "Global mini-batch, in samples")->capture_default_str();
  cmd.add_option("--micro-batches", c.micro_batches, "Micro-batches per mini-batch and replica")->capture_default_str();
  cmd.add_option("--optimizer", o.kind, "adamw or sgd")->capture_default_str();
  cmd.add_option("--lr", o.lr, "Peak learning rate")->capture_default_str();
  cmd.add_option("--min-lr-ratio", o.min_lr_ratio, "The decay ends at lr times this")->capture_default_str();
  cmd.add_option("--lr-schedule", o.lr_schedule,
                 "After the warm-up: cosine, linear or wsd decay to lr x --min-lr-ratio, or constant")
      ->capture_default_str();
  cmd.add_option("--lr-decay-steps", o.lr_decay_steps,
                 "The step the decay ends at, whatever --steps says (0: --steps); lets a run train in "
                 "several jobs, or be extended, without its schedule changing")
      ->capture_default_str();
  cmd.add_option("--wsd-decay", o.wsd_decay,
                 "wsd (warm-up, stable, decay): the last fraction of the decay steps that decays, linearly")
      ->capture_default_str();
  cmd.add_option("--weight-decay", o.weight_decay, "Decoupled weight decay (matrices only)")->capture_default_str();
  cmd.add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
  cmd.add_option("--warmup", o.warmup, "Steps of linear learning-rate warm-up")->capture_default_str();
  cmd.add_option("--clip-grad", o.clip_grad, "Clip the global gradient norm to this (0: off)")->capture_default_str();
  cmd.add_option("--steps", c.steps, "Train up to this step")->capture_default_str();
  cmd.add_option("--seed", c.seed, "Seed of initialisation, data and dropout")->check(seed_check())->capture_default_str();
  cmd.add_option("--threads", c.threads, "Threads per rank (BLAS and loops); 0: the cores given to the rank")
      ->capture_default_str();
  cmd.add_option("--log-every", c.log_every, "Print a line every N steps")->capture_default_str();
  cmd.add_option("--eval-data", c.eval_data,
                 "Held-out data to evaluate on (synthetic, text:PATH, tokens:PATH or hdf5:PATH; empty: none): forward "
                 "only, dropout off; loss and accuracy")
      ->capture_default_str();
  cmd.add_option("--data-packing", c.data_packing,
                 "Where a window of text or token data starts: windows (any position) or documents (a document's start: "
                 "a shard's first token or the one after an end-of-text id; docs/data.md)")
      ->capture_default_str();
  cmd.add_option("--eot-id", c.eot_id,
                 "The end-of-text id that separates documents (--data-packing documents); -1: the llm.c shards' own "
                 "(GPT-2 50256, Llama 3 128001)")
      ->capture_default_str();
  cmd.add_option("--sample-every", c.sample_every,
                 "A GPT: every N steps print a continuation of --sample-prompt (temperature 0.8, top-k 40; rank 0 gathers "
                 "the weights); 0: never")
      ->capture_default_str();
  cmd.add_option("--sample-tokens", c.sample_tokens, "Tokens of each --sample-every continuation")->capture_default_str();
  cmd.add_option("--sample-prompt", c.sample_prompt, "The prompt --sample-every continues (bytes; default a newline)");
  cmd.add_option("--eval-every", c.eval_every, "Evaluate every N steps, and at the end (0: only at the end)")
      ->capture_default_str();
  cmd.add_option("--eval-batches", c.eval_batches,
                 "Batches of --batch-size per evaluation (0: a file's every whole batch; 8 of endless data)")
      ->capture_default_str();
  cmd.add_option("--prefetch", c.prefetch,
                 "Read the next step's batch on a thread of its own while a step computes: auto (= on), on or "
                 "off. On the CPU the reader runs only where a core would idle. Synthetic data and token files; "
                 "an HDF5 file is read at each step")
      ->capture_default_str();
  cmd.add_option("--progress", c.progress,
                 "A live progress line on rank 0 between the logged steps: auto (when a person watches: "
                 "standard output, and under mpirun the launcher's, is a terminal), on or off")
      ->capture_default_str();
  cmd.add_option("--metrics", c.metrics, "Write one JSON object per step to FILE (the last line: the run's summary)");
  cmd.add_option("--summary", c.summary, "Write the run's summary (throughput, bubble, peak memory) as JSON to FILE");
  cmd.add_option("--trace", c.trace, "Write every rank's actions as a Chrome/Perfetto trace to FILE.json");
  cmd.add_option("--trace-steps", c.trace_steps, "Steps traced, after the first")->capture_default_str();
  cmd.add_option("--profile-ops", c.profile_ops,
                 "Time step N's ops by kind (GEMM, attention, convolution, normalization, elementwise, loss, optimizer, "
                 "copies; on a GPU by CUDA events) on every rank and print the table after that step; 0: none")
      ->capture_default_str();
  cmd.add_option("--stages", p.grid.stages, "Pipeline stages K (0: world size / replicas)")->capture_default_str();
  cmd.add_option("--replicas", p.grid.replicas, "Data-parallel replicas D (0: world size / stages)")->capture_default_str();
  cmd.add_option("--rank-order", p.grid.rank_order, "pipeline (a replica's stages on consecutive ranks), data (a stage's replicas), or auto: on "
                 "several hosts the one sending fewer bytes between them per step, else pipeline")
      ->capture_default_str();
  std::string schedules;  // the table's, each with its note
  for (const ScheduleKind& kind : schedule_kinds())
    schedules += cat(kind.name, kind.help.empty() ? "" : cat(" (", kind.help, ")"), ", ");
  cmd.add_option("--schedule", p.schedule,
                 schedules + "or file:PATH (a line 'stage S: F0 F1 B0 ...' per stage; plan --write-schedule writes one)")
      ->capture_default_str();
  cmd.add_option("--virtual-stages", p.virtual_stages,
                 "Model stages per rank, for --schedule interleaved (2 or more; stage m on pipeline stage m mod K); "
                 "zbv sets 2 (stages s and 2K-1-s on pipeline stage s)")
      ->capture_default_str();
  cmd.add_option("--remat", p.remat, "Re-materialization: never; selective (keep GEMM inputs and outputs, recompute LayerNorm and GELU "
                 "outputs in backward); except-last or always (recompute whole stages); auto (per stage the first of "
                 "never, selective and always that fits --memory-per-rank)")->capture_default_str();
  cmd.add_option("--batchnorm", p.batchnorm,
                 "BatchNorm's running statistics: micro (moved by each micro-batch, GPipe) or deferred (by the "
                 "mini-batch once per step, torchgpipe)")
      ->capture_default_str();
  cmd.add_option("--memory-per-rank", p.memory_per_rank,
                 "SIZE each rank may fill (weights, optimizer state, activations), e.g. 8GiB: what --remat auto fits "
                 "into");
  cmd.add_option("--partition", p.partition, "Balance stages by uniform, params, flops or time")->capture_default_str();
  cmd.add_option("--balance", p.balance, "Layers per stage, e.g. 3,5 (overrides --partition)");
  cmd.add_option("--link-bandwidth", p.link_bandwidth,
                 "Links between stages, counted by --partition time (a stage's time includes moving its boundary "
                 "activations and gradients): auto (measured by train; plan does not count them), off, or GB/s")
      ->capture_default_str();
  cmd.add_option("--p2p-timeout", p.p2p_timeout, "Seconds a point-to-point wait may block")->capture_default_str();
  cmd.add_option("--comm-progress", p.comm_progress,
                 "How posted messages move while a rank computes: thread (a progress thread), layers (tests "
                 "between layers), waits (only in waits: MPI's own progress) or auto (layers where every rank "
                 "shares one node and Open MPI's shared memory copies by single-copy, thread otherwise)")
      ->capture_default_str();
  cmd.add_option("--comm-poll-us", p.comm_poll_us,
                 "Microseconds between the progress thread's tests while nothing moves (0: no pause)")
      ->capture_default_str();
  cmd.add_option("--comm-wait", p.comm_wait,
                 "How a wait passes the time once nothing moves: sleep (from 20 us to 1 ms between tests) or "
                 "spin (tests without pause: a few % faster on small models, but takes the core from every "
                 "other process on the node)")
      ->capture_default_str();
  cmd.add_option("--in-flight", p.in_flight,
                 "zb-h1, zb-h2, zbv: the most micro-batches (zbv: model stages of micro-batches) a rank holds "
                 "between their F and their W, memory traded for bubble (0: the schedule's own, K, 2K-1 and 2K; "
                 "1f1b: on each rank what 1F1B holds there, K - rank, so that no rank needs more activation memory "
                 "than under 1F1B)")
      ->transform(CLI::Validator(
          [](std::string& text) {
            static_assert(in_flight_of_1f1b == -1);
            if (text == "1f1b") text = "-1";
            else if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos)
              return "must be a number of micro-batches (0: the schedule's own) or 1f1b, got " + text;
            return std::string();
          },
          "N|1f1b"))
      ->capture_default_str();
  cmd.add_flag("--overlap-steps,!--no-overlap-steps", p.overlap_steps,
               "Post-validation: each rank updates as soon as its part of a step is done and starts the next "
               "step while the world agrees on the loss and norm; a step that needs clipping or a skip is undone "
               "and redone (bitwise the same training). Lets zb-h2 fill its warm-up with the last step's "
               "cool-down")
      ->capture_default_str();
  cmd.add_flag("--shard-optimizer,!--no-shard-optimizer", p.shard_optimizer,
               "ZeRO-1: each of a stage's D replicas keeps and updates 1/D of its optimizer state (AdamW's moments, "
               "SGD's momentum), then the updated values are gathered; bitwise the same training, 1/D of the "
               "optimizer memory")
      ->capture_default_str();
  cmd.add_option("--device", c.device, "cpu, cuda (one GPU per rank: node-local rank modulo GPUs) or auto")
      ->capture_default_str();
  cmd.add_option("--precision", c.precision, "fp32, or bf16 on a GPU (fp32 master weights and optimizer state)")
      ->capture_default_str();
  cmd.add_option("--cuda-graphs", c.cuda_graphs,
                 "on (a GPU): from the third step, each micro-batch's forward, backward, weight gradient and "
                 "recomputation is recorded and launched as one CUDA graph (updated in place each step: the same "
                 "bits, fewer launch gaps with small micro-batches); off: kernels launched one by one")
      ->capture_default_str();
  cmd.add_option("--channels-last", c.channels_last,
                 "on: images (N, C, H, W) lie in memory as NHWC in every image layer (on a GPU cuDNN's NHWC "
                 "convolutions, with no transposes; on the CPU each image op swaps to channels first and back: the same "
                 "bits, slower); off: NCHW")
      ->capture_default_str();
  cmd.add_option("--checkpoint-dir", c.checkpoint_dir, "Write HDF5 checkpoints DIR/ckpt-<step>.h5 (created if missing)");
  cmd.add_option("--checkpoint-every", c.checkpoint_every, "Steps between checkpoints (0: only the final one)")
      ->capture_default_str();
  cmd.add_option("--time-limit", c.time_limit,
                 "Stop in time: once the next step and a checkpoint would not fit in this much time from the "
                 "start (MINUTES, or Slurm's [D-]H:MM:SS / MM:SS), write a checkpoint and exit 75, as on SIGTERM");
  cmd.add_option("--checkpoint-async", c.checkpoint_async,
                 "on: each --checkpoint-every checkpoint is written by a thread while training goes on, from a copy "
                 "taken in memory before the next update (the same file; the final one and one at a stop are written "
                 "at once); off: at its step; auto: on where MPI takes calls from two threads")
      ->capture_default_str();
  cmd.add_option("--keep", c.keep, "Complete checkpoints to keep (0: all)")->capture_default_str();
  cmd.add_option("--resume", c.resume, "auto (newest good checkpoint in --checkpoint-dir), never, or a file")
      ->capture_default_str();
  cmd.add_option("--init-from", c.init_from,
                 "Start a fresh run (step 0, a fresh optimizer) from the weights of a safetensors file, a sharded "
                 "checkpoint's *.safetensors.index.json or a directory holding either (what 'mpipe export' writes; GPT and "
                 "Llama: Hugging Face's names, F32, BF16 or F16, a config.json beside them checked); every name, shape and "
                 "dtype checked. A run that resumes a checkpoint goes on from it instead");
  cmd.add_flag("--overwrite", c.overwrite,
               "Let this run replace the checkpoints of another run in --checkpoint-dir (deleted once its first "
               "checkpoint is in place); without it such a directory is refused");
}

void add_generate_options(CLI::App& cmd, GenerateOptions& g) {
  cmd.add_option("--checkpoint", g.checkpoint, "Checkpoint file (ckpt-*.h5), or a run's --checkpoint-dir (its newest that verifies)")
      ->required();
  cmd.add_option("--prompt", g.prompt, "The prompt as text, its bytes the tokens (a vocabulary of bytes; default: a newline)");
  cmd.add_option("--prompt-tokens", g.prompt_tokens, "The prompt as a file of little-endian uint16 token ids");
  cmd.add_option("--tokenizer", g.tokenizer,
                 "A tokenizer (tokenizer.model, tokenizer.json or a directory holding one): --prompt is encoded by it and "
                 "the continuation decoded (--output ids keeps ids); its vocabulary must not exceed the model's");
  cmd.add_option("--tokens", g.tokens, "Tokens to generate per sample")->capture_default_str();
  cmd.add_option("--samples", g.samples, "Continuations of the prompt (in flight together: across ranks the stages overlap)")
      ->capture_default_str();
  cmd.add_option("--temperature", g.sampling.temperature, "Softmax temperature; 0: greedy (the most likely token)")
      ->capture_default_str();
  cmd.add_option("--top-k", g.sampling.top_k, "Draw from the K most likely tokens only (0: all)")->capture_default_str();
  cmd.add_option("--top-p", g.sampling.top_p, "Draw from the most likely tokens that together reach this probability (1: all)")
      ->capture_default_str();
  cmd.add_option("--seed", g.seed, "Seed of the draws: the same seed, the same text")->check(seed_check())->capture_default_str();
  cmd.add_option("--output", g.output, "text (the tokens' bytes, or with --tokenizer their text), ids, or auto: text for a "
                 "vocabulary of bytes given --prompt, or with --tokenizer")
      ->capture_default_str();
  cmd.add_option("--device", g.device, "cpu, cuda or auto")->capture_default_str();
  cmd.add_option("--precision", g.precision, "fp32, or bf16 on a GPU")->capture_default_str();
  cmd.add_option("--threads", g.threads, "Threads per rank (a wide model may gain from more); 0: the cores given to the rank")
      ->capture_default_str();
  cmd.add_option("--p2p-timeout", g.p2p_timeout, "Seconds a rank may stop answering before the job ends naming it")->capture_default_str();
}

void add_tokenize_options(CLI::App& cmd, TokenizeOptions& t) {
  cmd.add_option("--tokenizer", t.tokenizer,
                 "A SentencePiece model (tokenizer.model), a Hugging Face byte-level BPE tokenizer.json, or a directory "
                 "holding one")
      ->required();
  cmd.add_option("inputs", t.inputs, "Text files, each one document unless --document-separator splits it; - reads standard input")
      ->required();
  cmd.add_option("--out", t.out, "Directory of the shards, OUT/PREFIX_000000.bin, ... (created if missing)")->required();
  cmd.add_option("--prefix", t.prefix, "The shards' name before _000000.bin")->capture_default_str();
  cmd.add_option("--document-separator", t.document_separator,
                 "Split each input into documents at this text (e.g. a blank line written with $'\\n\\n'); each "
                 "document follows an end-of-text id");
  cmd.add_option("--shard-size", t.shard_size, "Tokens per shard")->capture_default_str();
  cmd.add_option("--threads", t.threads, "Threads encoding documents (a document is never split); 0: the cores")
      ->capture_default_str();
  cmd.add_option("--eot-id", t.eot_id, "The id before each document (default: the tokenizer's end-of-text)");
  cmd.add_flag("--bos", t.bos, "Also begin each document with the tokenizer's begin-of-text id");
  cmd.add_option("--progress", t.progress, "A live progress line on standard error: auto (a terminal), on or off")
      ->capture_default_str();
}

int run_main(int argc, char** argv) {
  // MPI comes up first for train and generate, so that under mpirun only rank 0 reports.
  const bool training = argc > 1 && std::strcmp(argv[1], "train") == 0;
  const bool with_mpi = training || (argc > 1 && std::strcmp(argv[1], "generate") == 0);
  int rank = 0, already = 0;
  MPI_Initialized(&already);  // tests call run_main with MPI up
  const bool own_mpi = with_mpi && !already;
  if (training) install_stop_handlers(environ);  // again: a test may call run_main
  if (own_mpi) {
    // Until the watchdog runs, a rank stopped in MPI's start-up would hang the others there.
    arm_startup_deadline(p2p_timeout_of(argc, argv, default_p2p_timeout), "MPI_Init");
    set_mpi_transfer_defaults();  // read by MPI_Init
    fault_point("MPI_Init");
    // MULTIPLE for the communication progress thread (Progress falls back without it).
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    startup_phase("the options");
  }
  if (with_mpi) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  auto finish = [&](int code) {
    if (own_mpi) {
      startup_phase("MPI_Finalize");
      MPI_Finalize();
      disarm_startup_deadline();
    }
    return code;
  };

  CLI::App app{"mpipe: GPipe micro-batch pipeline-parallel training on MPI", "mpipe"};
  app.set_version_flag("--version", cat("mpipe ", version(), " (git ", git_hash(), ")"));
  app.require_subcommand(1);
  TrainConfig train_config, plan_config;
  CLI::App* train = app.add_subcommand("train", "Train a model (under mpirun/srun: one stage per rank)");
  add_train_options(*train, train_config);
  CLI::App* plan = app.add_subcommand("plan", "Print the grid, partition, schedule and bubble for --ranks, without MPI");
  add_train_options(*plan, plan_config);
  int plan_ranks = 1;
  plan->add_option("--ranks", plan_ranks, "Number of ranks to plan for")->capture_default_str();
  int plan_ranks_per_node = 0;
  plan->add_option("--ranks-per-node", plan_ranks_per_node,
                   "Ranks per node, placed in blocks (mpirun by slot, srun's block distribution): with replicas and "
                   "stages across nodes, each rank order's bytes between nodes and --rank-order auto's choice (0: one node)")
      ->capture_default_str();
  std::string write_schedule;
  plan->add_option("--write-schedule", write_schedule,
                   "Also write the schedule's actions per stage to this file, for editing and --schedule file:PATH");
  bool print_model = false, layer_kinds_help = false;
  plan->add_flag("--print-model", print_model,
                 "Print only the model's layer list as a model file (mpipe plan --model gpt --print-model > m.toml; "
                 "mpipe train --model m.toml)");
  plan->add_flag("--layer-kinds", layer_kinds_help, "List the layer kinds a model file may use, with their options");
  CLI::App* inspect = app.add_subcommand("inspect", "Show a checkpoint: tree, shapes, parameter counts, step, config");
  std::string inspect_path;
  bool inspect_stats = false, inspect_verify = false, inspect_config = false, inspect_model = false;
  inspect->add_option("file", inspect_path, "Checkpoint file (ckpt-*.h5)")->required();
  inspect->add_flag("--stats", inspect_stats, "Per-tensor min, max, mean, std and norm");
  inspect->add_flag("--verify", inspect_verify, "Check every checksum; exit code 2 on damage");
  inspect->add_flag("--config", inspect_config,
                    "Print only the run's options, as a file for 'train --config' (mpipe inspect CKPT --config > "
                    "run.toml)");
  inspect->add_flag("--model", inspect_model,
                    "Print only the model's layer list, as a model file for 'train --model' (mpipe inspect CKPT --model > "
                    "m.toml)");
  CLI::App* export_command = app.add_subcommand(
      "export", "Write a checkpoint's weights as safetensors (GPT, Llama: Hugging Face's names; ResNet: torchvision's; else the layer list's)");
  std::string export_from, export_to;
  export_command->add_option("checkpoint", export_from, "Checkpoint file, or a run's --checkpoint-dir (its newest that verifies)")
      ->required();
  export_command->add_option("out", export_to,
                             "The .safetensors file to write, or a directory (a name ending in '/', or one that exists): "
                             "DIR/model.safetensors and, for GPT and Llama, the config.json Hugging Face reads")
      ->required();
  CLI::App* generate = app.add_subcommand(
      "generate", "Continue a prompt with a GPT checkpoint (under mpirun/srun: the layers split over the ranks)");
  GenerateOptions g;
  add_generate_options(*generate, g);
  CLI::App* tokenize = app.add_subcommand("tokenize", "Encode text files with a tokenizer into llm.c token shards (docs/tokenizers.md)");
  TokenizeOptions tokenize_options;
  add_tokenize_options(*tokenize, tokenize_options);
  app.footer(kAppExamples);
  train->footer(kTrainExamples);
  plan->footer(kPlanExamples);
  inspect->footer(kInspectExamples);
  export_command->footer(kExportExamples);
  generate->footer(kGenerateExamples);
  tokenize->footer(kTokenizeExamples);

  try {
    app.parse(argc, argv);
    if (train->parsed()) apply_config_file(*train);
    if (plan->parsed()) apply_config_file(*plan);
    // A model file has its own sizes: the presets' options would be ignored.
    for (const auto& [command, config] : {std::pair{train, &train_config}, std::pair{plan, &plan_config}}) {
      if (!command->parsed()) continue;
      // A schedule that always runs a fixed number of model stages per rank (zbv: two)
      // sets --virtual-stages unless given.
      if (const ScheduleKind* kind = find_schedule_kind(config->pipeline.schedule);
          kind && kind->virtual_stages > 1 && config->pipeline.virtual_stages == 1)
        config->pipeline.virtual_stages = kind->virtual_stages;
      // ResNet's depth is one of five: 18 unless given.
      if (config->model.kind == "resnet" && command->get_option("--layers")->count() == 0) config->model.layers = 18;
      if (is_preset(config->model.kind)) continue;
      for (const char* name : {"--layers", "--d-model", "--heads", "--seq-len", "--vocab", "--hidden", "--inputs", "--classes",
                               "--image", "--channels", "--width", "--dropout"})
        MPIPE_REQUIRE(command->get_option(name)->count() == 0, "set it in the model file (mpipe plan --layer-kinds lists the keys)",
                      name, " sizes the presets (gpt, mlp, resnet); model file '", config->model.kind, "' has its own");
    }
  } catch (const CLI::CallForHelp& e) {
    return finish(rank == 0 ? app.exit(e) : 0);
  } catch (const CLI::CallForAllHelp& e) {
    return finish(rank == 0 ? app.exit(e) : 0);
  } catch (const CLI::CallForVersion& e) {
    return finish(rank == 0 ? app.exit(e) : 0);
  } catch (const CLI::ParseError& e) {
    // No subcommand parsed: name what was typed (a mistyped "trian" is not a subcommand).
    const bool none = !train->parsed() && !plan->parsed() && !inspect->parsed() && !export_command->parsed() &&
                      !generate->parsed() && !tokenize->parsed();
    if (none && argc > 1 && argv[1][0] != '-') {
      if (rank == 0)
        std::fprintf(stderr, "mpipe: error: unknown command '%s'; hint: use mpipe train, plan, inspect, export, generate or tokenize (mpipe --help)\n",
                     argv[1]);
      return finish(exit_user_error);
    }
    const CLI::App* typed_to = train->parsed()            ? train
                               : plan->parsed()           ? plan
                               : inspect->parsed()        ? inspect
                               : export_command->parsed() ? export_command
                               : generate->parsed()       ? generate
                                                          : &app;
    const std::string suggestion = did_you_mean(*typed_to, argc, argv);
    if (rank == 0)
      std::fprintf(stderr, "mpipe: error: %s; hint: %ssee 'mpipe %s--help'\n", e.what(), suggestion.c_str(),
                   train->parsed()            ? "train "
                   : plan->parsed()           ? "plan "
                   : inspect->parsed()        ? "inspect "
                   : export_command->parsed() ? "export "
                   : generate->parsed()       ? "generate "
                   : tokenize->parsed()       ? "tokenize "
                                              : "");
    return finish(exit_user_error);
  } catch (const UserError& e) {
    if (rank == 0) std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
    return finish(exit_user_error);
  }

  if (train->parsed()) {
    int code = exit_internal_error;
    try {
      const Communicator world = Communicator::borrow(MPI_COMM_WORLD);
      startup_phase("hosts", train_config.pipeline.p2p_timeout);  // a --config file's timeout too
      code = run_train(train_config, world);
    } catch (const std::exception& e) {
      // Outside the guarded phases: one line, then end every rank.
      std::fflush(stdout);
      std::fprintf(stderr, "mpipe: error on rank %d: %s\n", rank, e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, exit_internal_error);
    }
    return finish(code);
  }
  if (generate->parsed()) {
    g.prompt_given = generate->get_option("--prompt")->count() > 0;
    try {
      const Communicator world = Communicator::borrow(MPI_COMM_WORLD);
      return finish(run_generate(g, world));
    } catch (const UserError& e) {  // the options or the device: the same on every rank
      if (rank == 0) std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
      return finish(exit_user_error);
    }
  }
  try {
    if (export_command->parsed()) return run_export(export_from, export_to);
    if (tokenize->parsed()) return run_tokenize(tokenize_options);
    if (inspect->parsed())
      return run_inspect(inspect_path, inspect_stats, inspect_verify, inspect_config ? "config" : inspect_model ? "model" : "");
    if (layer_kinds_help) return print_layer_kinds();
    if (print_model) {
      std::fputs(model_spec(plan_config.model).to_toml().c_str(), stdout);
      return 0;
    }
    return run_plan(plan_config, plan_ranks, write_schedule, plan_ranks_per_node);
  } catch (const UserError& e) {
    std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
    return exit_user_error;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpipe: internal error: %s\n", e.what());
    return exit_internal_error;
  }
}

}  // namespace mpipe
