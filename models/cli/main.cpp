// kiln: the command-line tool. Pretrains the bundled models, generates from them, measures
// training throughput, lists the configs.
//
//   kiln configs
//   kiln pretrain [--config NAME|FILE.toml | --hf DIR] [--data FILE] [--steps N] [--batch B] ...
//   kiln generate (--checkpoint DIR | --hf DIR | --config NAME) (--prompt "1 2 3" | --text "...")
//                 [--tokenizer tokenizer.json] ...
//   kiln bench --config NAME [--batch B] [--seq T] [--steps N] [--precision P] [--compile]
//              [--no-cuda-graphs] [--no-matmul-autotune] [--profile] [--adam-state f32|param]
//              [--dist ddp|zero2|zero3] [--nccl-all-reduce]
//   kiln tokenizer train [--data FILE] [--vocab-size N] [--out FILE] [--special A,B]
//   kiln run --nproc-per-node N [--nnodes M --node-rank R --master-addr A] program args...
//   kiln help
//
// Arguments are parsed by hand, strictly: every flag must belong to the subcommand, every value
// must parse completely; anything else prints the usage and exits with status 2. Errors while
// running (a missing file, a bad config) print kiln's message and exit with status 1.
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dist/launcher.h"
#include "models/cli/prepare.h"
#include "models/config.h"
#include "models/generate.h"
#include "models/gpt.h"
#include "models/hf.h"
#include "models/run_config.h"
#include "models/tokenizer.h"
#include "models/trainer.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "text/bpe_trainer.h"
#include "text/tokenizer.h"

#ifndef KILN_SOURCE_DIR
#define KILN_SOURCE_DIR "."
#endif

namespace {

using kiln::models::PretrainOptions;

// The defaults of `kiln pretrain`: kiln-tiny on tiny Shakespeare, sized so that the loss falls
// visibly (from ~5.5 to under 2.5) in a few minutes on a 2-core CPU.
constexpr int64_t kDefaultSteps = 200;
constexpr int64_t kDefaultBatch = 8;
constexpr int64_t kDefaultSeq = 128;
constexpr double kDefaultLr = 3e-3;

const char* const kUsage = R"(usage: kiln <command> [flags]

commands:
  configs                      list the registered model configs with their parameter counts
  pretrain [flags]             pretrain a model on a text or token file
      --config NAME            model config (default: kiln-tiny)
      --hf DIR                 ... or a Hugging Face checkpoint directory (config.json,
                               safetensors, tokenizer.json): continued pretraining or
                               fine-tuning from its weights; a text --data is tokenised
                               with its tokenizer.json, shards must be of that tokenizer
      --config FILE.toml       ... or a run configuration file: any of these settings and
                               more (docs/models.md); flags override it. Every run writes
                               the settings it ran with to <out>/run.toml
      --data PATH              text file (byte tokens), .bin/.u16/.u32 token file, or token
                               shards of `kiln prepare`: a directory or .tokens files
                               separated by commas (default: data/tinyshakespeare.txt)
      --steps N                optimizer steps (default: 200)
      --batch B                sequences per step (default: 8)
      --seq T                  tokens per sequence (default: 128)
      --lr X                   peak learning rate (default: 3e-3; cosine to lr/10)
      --precision P            f32 | bf16-true | bf16-mixed (default: f32)
      --device D               cpu | cuda (default: cuda when available)
      --out DIR                checkpoint directory (default: out/<config> or out/<hf dir>)
      --resume                 continue from the checkpoint in --out, with its data, batch,
                               seq, seed and lr schedule (flags that differ are an error)
      --allow-resume-changes   resume even though --data, --batch, --seq, --seed, --lr or
                               --lr-decay-steps differ from the checkpoint's (they win)
      --skip-nonfinite         skip a step whose loss or gradient norm is NaN or infinite
                               (no update) instead of stopping; either way a non-finite
                               value never replaces the last good checkpoint
      --lr-decay-steps N       the lr schedule's length (default: --steps); a run may stop
                               earlier and be resumed on the same schedule: `--steps 20
                               --lr-decay-steps 40` then `--resume --steps 40` gives the
                               weights of `--steps 40` bit for bit
      --save-every N           a checkpoint every N steps too (default: only at the end;
                               SIGINT/SIGTERM also save one and stop)
      --keep K                 checkpoints kept, the newest (default: 1)
      --no-progress            plain lines even on a terminal (no progress bar)
      --seed S                 seed of the initialisation and the batches (default: 1337)
      --compile                run the training step through kiln::compile (traced on steps
                               1 and 2, replayed after; the same losses as eager); the
                               default on CUDA (not with --deterministic)
      --no-compile             run the training step eagerly (the default on the CPU)
      --no-cuda-graphs         with --compile on CUDA: run the step's kernels one by one
                               instead of as CUDA graphs (captured at step 3)
      --no-matmul-autotune     on CUDA: each matrix product takes cuBLASLt's first heuristic
                               choice instead of the fastest candidate timed at its shape's
                               first call (the default; off with --deterministic)
      --deterministic          deterministic algorithms: the same bits on every run and
                               bit-exact --resume on CUDA (attention's backward runs
                               unfused: slower, more memory)
      --dist M                 ddp | zero2 | zero3 (= fsdp): data parallel over the ranks of
                               `kiln run --nproc-per-node N kiln pretrain ...` (NCCL on GPUs,
                               Gloo on CPUs); --batch is per rank; rank 0 logs and saves
  generate [flags]             generate tokens from a checkpoint or a freshly initialised model
      --checkpoint DIR         a `kiln pretrain` output directory
      --hf DIR                 ... or a Hugging Face checkpoint (config.json + safetensors)
      --config NAME            ... or a config, randomly initialised (with --seed)
      --prompt "1 2 3"         prompt token ids (spaces or commas)
      --text "..."             ... or a text prompt (bytes, or --tokenizer's tokens); prints
                               the decoded text too
      --tokenizer FILE         a Hugging Face tokenizer.json for --text and the printed text
                               (default: the --hf directory's tokenizer.json, else bytes)
      --max-new-tokens N       (default: 100)
      --temperature X          0 = greedy (default: 0.8)
      --top-k K                0 = off (default: 0)
      --top-p P                1 = off (default: 1)
      --seed S                 sampling seed (default: 0)
      --stop ID,...            stop after any of these token ids
      --device D               cpu | cuda (default: cuda when available)
  bench --config NAME [flags]  training-step throughput on random tokens (AdamW, warm-up
                               steps excluded): tok/s, MFU, peak GPU memory
      --batch B --seq T        (default: llama-160m 16 x 1024, llama-3.2-1b 4 x 2048,
                               others 8 x min(256, context))
      --steps N                timed steps (default: 10, after 3 warm-up steps)
      --precision P            (default: bf16-true on cuda, f32 on cpu)
      --device D               cpu | cuda (default: cuda when available)
      --compile                time the training step compiled with kiln::compile (its GPU
                               work as CUDA graphs; prints whether it ran as graphs, or why not)
      --no-cuda-graphs         with --compile: without CUDA graphs (kernels one by one)
      --no-matmul-autotune     on CUDA: cuBLASLt's first heuristic choice per product, not the
                               fastest candidate timed at the shape's first call (the default)
      --profile                then profile 3 more steps: time per kernel family and the
                               slowest kernels (kiln::profiler; CUDA events on a GPU)
      --adam-state S           f32 | param: AdamW's moments in f32 (default) or in the
                               parameters' dtype (bf16 under bf16-true, as PyTorch's AdamW)
      --dist M                 ddp | zero2 | zero3 (= fsdp), under `kiln run`: --batch per
                               rank; prints every rank's tok/s and the largest peak memory
      --comm-sm-carveout N     with --dist ddp on CUDA: the matrix products leave N SMs to
                               the gradients' all-reduces during the backward (default 0)
      --ddp-bucket-mb X        with --dist ddp: the gradient buckets' size in MiB, torch
                               DDP's bucket_cap_mb (default 25)
      --ddp-tail-buckets N     with --dist ddp: the last N buckets are all-reduced by NCCL's
                               kernels, the others beside the backward by the copy engines
                               (default 1)
      --nccl-all-reduce        with --dist on CUDA: DDP's gradient all-reduces run NCCL's
                               kernels, not the copy engines (the default on one host)
  tokenizer train [flags]      train a byte-level BPE tokenizer (Llama 3 style) and write its
                               tokenizer.json (kiln::text::Tokenizer and Hugging Face load it)
      --data FILE              UTF-8 text (default: the bundled data/tinyshakespeare.txt)
      --vocab-size N           tokens, the 256 bytes and the special tokens included
                               (default: 8192)
      --min-frequency N        merge only pairs seen at least N times (default: 2)
      --special A,B,...        special tokens, the first is bos
                               (default: <|begin_of_text|>,<|end_of_text|>)
      --out FILE               (default: out/tokenizer.json)
  prepare INPUT... --out DIR   text and JSONL files -> token shards for pretrain --data
                               (kiln prepare --help lists its flags)
  run --nproc-per-node N PROG  start the ranks of a distributed job (kiln run --help)
  help                         this message
)";

struct UsageError {
  std::string message;
};

// Flags of one subcommand: name -> value ("" for a switch).
using Flags = std::map<std::string, std::string>;

Flags parse_flags(const std::vector<std::string>& args, const std::set<std::string>& with_value,
                  const std::set<std::string>& switches) {
  Flags flags;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    if (arg.rfind("--", 0) != 0) throw UsageError{"unexpected argument '" + arg + "'"};
    std::optional<std::string> inline_value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    const std::string name = arg.substr(2);
    if (flags.contains(name)) throw UsageError{"--" + name + " given twice"};
    if (switches.contains(name)) {
      if (inline_value) throw UsageError{"--" + name + " takes no value"};
      flags[name] = "";
    } else if (with_value.contains(name)) {
      if (inline_value) {
        flags[name] = *inline_value;
      } else {
        if (i + 1 >= args.size()) throw UsageError{"--" + name + " needs a value"};
        flags[name] = args[++i];
      }
    } else {
      throw UsageError{"unknown flag --" + name};
    }
  }
  return flags;
}

int64_t parse_int(const std::string& flag, const std::string& s) {
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) {
    throw UsageError{"--" + flag + ": '" + s + "' is not an integer"};
  }
  return v;
}

uint64_t parse_uint(const std::string& flag, const std::string& s) {
  uint64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) {
    throw UsageError{"--" + flag + ": '" + s + "' is not a non-negative integer"};
  }
  return v;
}

double parse_double(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) {
    throw UsageError{"--" + flag + ": '" + s + "' is not a number"};
  }
  // strtod also reads "inf", "nan" and overflows to infinity: no flag wants those.
  if (!std::isfinite(v)) throw UsageError{"--" + flag + ": '" + s + "' is not a finite number"};
  return v;
}

// An integer flag that must be at least `min`.
int64_t parse_int_at_least(const std::string& flag, const std::string& s, int64_t min) {
  const int64_t v = parse_int(flag, s);
  if (v < min) {
    throw UsageError{"--" + flag + " must be " +
                     (min == 1 ? "positive" : ">= " + std::to_string(min)) + ", got " + s};
  }
  return v;
}

// --batch x --seq (x more factors): the tokens of a step, which must fit in int64.
void check_tokens_per_step(int64_t batch, int64_t seq) {
  int64_t tokens = 0;
  if (__builtin_mul_overflow(batch, seq, &tokens)) {
    throw UsageError{"--batch " + std::to_string(batch) + " x --seq " + std::to_string(seq) +
                     " tokens per step overflows int64"};
  }
}

// "1 2 3" or "1,2,3" (or a mix) -> ids.
std::vector<int64_t> parse_ids(const std::string& flag, const std::string& s) {
  std::vector<int64_t> ids;
  std::string token;
  auto flush = [&]() {
    if (!token.empty()) ids.push_back(parse_int(flag, token));
    token.clear();
  };
  for (char c : s) {
    if (c == ' ' || c == ',' || c == '\t' || c == '\n') {
      flush();
    } else {
      token.push_back(c);
    }
  }
  flush();
  return ids;
}

std::string parse_dist(const std::string& s) {
  if (s != "ddp" && s != "zero2" && s != "zero3" && s != "fsdp") {
    throw UsageError{"--dist must be ddp, zero2, zero3 or fsdp (= zero3), got '" + s + "'"};
  }
  return s;
}

kiln::Device parse_device(const std::string& s) {
  if (s == "cpu") return kiln::Device(kiln::kCPU);
  if (s == "cuda") return kiln::Device(kiln::kCUDA);
  throw UsageError{"--device must be cpu or cuda, got '" + s + "'"};
}

std::string human_count(int64_t n) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(2);
  if (n >= 1000000000) {
    s << static_cast<double>(n) / 1e9 << "B";
  } else if (n >= 1000000) {
    s << static_cast<double>(n) / 1e6 << "M";
  } else {
    s << static_cast<double>(n) / 1e3 << "K";
  }
  return s.str();
}

int cmd_configs(const std::vector<std::string>& args) {
  parse_flags(args, {}, {});
  for (const std::string& name : kiln::models::config_names()) {
    const auto cfg = kiln::models::ModelConfig::from_name(name);
    const int64_t n = cfg.num_parameters();
    std::cout << std::left << std::setw(20) << name << std::right << std::setw(10) << human_count(n)
              << "  (" << n << " parameters)"
              << (name == kiln::models::kDefaultConfig ? "  [default]" : "") << "\n";
  }
  return 0;
}

// The name of a Hugging Face directory's model, as ModelConfig::from_hf_config gives it: the
// directory's own name ("hf" for ".").
std::string hf_model_name(const std::string& dir) {
  const std::string name =
      (std::filesystem::path(dir) / "config.json").lexically_normal().parent_path().filename();
  return name.empty() || name == "." ? "hf" : name;
}

int cmd_pretrain(const std::vector<std::string>& args) {
  const Flags f =
      parse_flags(args,
                  {"config", "hf", "data", "steps", "batch", "seq", "lr", "precision", "device",
                   "out", "seed", "save-every", "lr-decay-steps", "keep", "dist"},
                  {"resume", "compile", "no-compile", "no-cuda-graphs", "no-matmul-autotune",
                   "deterministic", "no-progress", "skip-nonfinite", "allow-resume-changes"});
  // --config FILE.toml: a run configuration file (models/run_config.h). Its settings count as
  // flags: the flags given override them, and they override the defaults and, on a resume, the
  // checkpoint's settings. It brings the options that have no flag too (weight_decay, betas, ...).
  kiln::models::RunConfig file;
  const bool config_file = f.contains("config") && f.at("config").ends_with(".toml");
  if (config_file) file = kiln::models::read_run_config(f.at("config"));
  const auto given = [&](const char* flag, const char* key) {
    return f.contains(flag) || file.has(key);
  };
  PretrainOptions o = file.options;
  // The model: --config NAME, --hf DIR (a Hugging Face checkpoint), or the file's; never two.
  if (f.contains("hf") && f.contains("config") && !config_file) {
    throw UsageError{"--hf " + f.at("hf") + " and --config " + f.at("config") +
                     " both name the model: give one"};
  }
  if (f.contains("hf") && file.has("model.name")) {
    throw UsageError{"--hf " + f.at("hf") + " and model.name in " + f.at("config") +
                     " both name the model: give one"};
  }
  if (f.contains("hf") && f.at("hf").empty()) throw UsageError{"--hf needs a directory"};
  o.hf_dir = f.contains("hf") ? f.at("hf") : file.has("model.hf") ? file.options.hf_dir : "";
  o.config_name = f.contains("config") && !config_file ? f.at("config")
                  : file.has("model.name")             ? file.options.config_name
                                                       : kiln::models::kDefaultConfig;
  o.out_dir = f.contains("out")                ? f.at("out")
              : file.has("checkpoint.out_dir") ? file.options.out_dir
              : o.hf_dir.empty()               ? "out/" + o.config_name
                                               : "out/" + hf_model_name(o.hf_dir);
  o.resume = f.contains("resume");
  o.allow_resume_changes = f.contains("allow-resume-changes");
  if (o.allow_resume_changes && !o.resume) {
    throw UsageError{"--allow-resume-changes goes with --resume"};
  }
  // A resume takes the checkpoint's settings for the flags not given, so that `--resume --steps
  // N` continues the run as it was; flags given and different are the library's error (unless
  // --allow-resume-changes).
  std::optional<kiln::models::CheckpointInfo> stored;
  if (o.resume) stored = kiln::models::read_checkpoint_info(o.out_dir);
  // A resume of a run from a Hugging Face directory continues on that model unless told.
  if (stored && stored->hf_dir && o.hf_dir.empty() && !f.contains("config") &&
      !file.has("model.name")) {
    o.hf_dir = *stored->hf_dir;
  }
  o.data_path = f.contains("data")      ? f.at("data")
                : file.has("data.path") ? file.options.data_path
                : stored && stored->data
                    ? *stored->data
                    : std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt";
  o.max_steps = f.contains("steps")          ? parse_int_at_least("steps", f.at("steps"), 1)
                : file.has("training.steps") ? file.options.max_steps
                                             : kDefaultSteps;
  o.batch_size = f.contains("batch")            ? parse_int_at_least("batch", f.at("batch"), 1)
                 : file.has("data.batch_size")  ? file.options.batch_size
                 : stored && stored->batch_size ? *stored->batch_size
                                                : kDefaultBatch;
  o.seq_len = f.contains("seq")           ? parse_int_at_least("seq", f.at("seq"), 1)
              : file.has("data.seq_len")  ? file.options.seq_len
              : stored && stored->seq_len ? *stored->seq_len
                                          : kDefaultSeq;
  check_tokens_per_step(o.batch_size, o.seq_len);
  o.lr = f.contains("lr")           ? parse_double("lr", f.at("lr"))
         : file.has("optimizer.lr") ? file.options.lr
                                    : kDefaultLr;
  if (!(o.lr > 0)) throw UsageError{"--lr must be positive, got " + f.at("lr")};
  if (!file.has("schedule.min_lr")) o.min_lr = o.lr / 10;
  // The schedule's length: --lr-decay-steps, else --steps; a resume keeps the checkpoint's.
  if (f.contains("lr-decay-steps")) {
    o.lr_decay_steps = parse_int_at_least("lr-decay-steps", f.at("lr-decay-steps"), 1);
  }
  if (!file.has("schedule.warmup_steps")) {
    o.warmup_steps =
        std::min<int64_t>(30, (o.lr_decay_steps > 0 ? o.lr_decay_steps : o.max_steps) / 10);
  }
  if (stored && stored->schedule) {
    if (!given("lr", "optimizer.lr")) o.lr = stored->schedule->lr;
    if (!given("lr", "schedule.min_lr")) o.min_lr = stored->schedule->min_lr;
    if (!given("lr-decay-steps", "schedule.lr_decay_steps")) {
      o.lr_decay_steps = stored->schedule->lr_decay_steps;
    }
    if (!given("lr-decay-steps", "schedule.warmup_steps")) {
      o.warmup_steps = stored->schedule->warmup_steps;
    }
  }
  if (!file.has("metrics.log_interval")) {
    o.log_interval = std::max<int64_t>(1, std::min<int64_t>(10, o.max_steps / 20));
  }
  if (!file.has("metrics.eval_interval")) o.eval_interval = std::max<int64_t>(1, o.max_steps / 3);
  if (f.contains("precision")) o.precision = f.at("precision");
  if (f.contains("device")) o.device = parse_device(f.at("device"));
  if (f.contains("no-cuda-graphs")) o.cuda_graphs = false;
  if (f.contains("no-matmul-autotune")) o.matmul_autotune = false;
  if (f.contains("dist")) o.dist = parse_dist(f.at("dist"));
  if (f.contains("skip-nonfinite")) o.skip_nonfinite = true;
  if (f.contains("deterministic")) o.deterministic = true;
  // Compiled by default on CUDA, where the compiled step is the faster one (benchmarks/RESULTS.md,
  // session 20); eager on the CPU and for --deterministic runs, unless asked.
  if (f.contains("compile") && f.contains("no-compile")) {
    throw UsageError{"--compile and --no-compile contradict each other: give one"};
  }
  if (f.contains("compile")) {
    o.compile = true;
  } else if (f.contains("no-compile")) {
    o.compile = false;
  } else if (!file.has("training.compile")) {
    o.compile = o.device.value_or(kiln::models::default_device()).is_cuda() && !o.deterministic;
  }
  if (f.contains("seed")) {
    o.seed = parse_uint("seed", f.at("seed"));
  } else if (!file.has("training.seed") && stored && stored->seed) {
    o.seed = *stored->seed;
  }
  if (f.contains("save-every")) {
    o.checkpoint_interval = parse_int_at_least("save-every", f.at("save-every"), 1);
  }
  if (f.contains("no-progress")) o.progress_bar = false;
  if (f.contains("keep")) o.keep_checkpoints = parse_int_at_least("keep", f.at("keep"), 1);
  const auto s = kiln::models::pretrain(o, std::cout);
  if (s.steps == s.start_step) return 0;  // resumed at or past --steps: pretrain said so
  if (s.rank != 0) return 0;              // rank 0 reports
  std::cout << "done: " << s.steps << " steps in " << std::fixed << std::setprecision(1)
            << s.seconds << " s | train loss " << std::setprecision(4) << s.final_train_loss
            << " | val loss " << s.final_val_loss << " | " << std::setprecision(0) << s.tokens_per_s
            << " tok/s";
  if (s.mfu) std::cout << " | MFU " << std::setprecision(1) << 100 * *s.mfu << "%";
  std::cout << "\ncheckpoint: " << o.out_dir << "  (try: kiln generate --checkpoint " << o.out_dir
            << " --text \"ROMEO:\")\n";
  return 0;
}

int cmd_generate(const std::vector<std::string>& args) {
  const Flags f =
      parse_flags(args,
                  {"checkpoint", "hf", "config", "prompt", "text", "max-new-tokens", "temperature",
                   "top-k", "top-p", "seed", "stop", "device", "tokenizer"},
                  {});
  if (f.contains("checkpoint") + f.contains("hf") + f.contains("config") != 1) {
    throw UsageError{"generate needs exactly one of --checkpoint, --hf and --config"};
  }
  if (f.contains("prompt") == f.contains("text")) {
    throw UsageError{"generate needs exactly one of --prompt and --text"};
  }
  kiln::models::GenerateOptions g;
  g.max_new_tokens = f.contains("max-new-tokens")
                         ? parse_int_at_least("max-new-tokens", f.at("max-new-tokens"), 0)
                         : 100;
  g.temperature =
      f.contains("temperature") ? parse_double("temperature", f.at("temperature")) : 0.8;
  if (g.temperature != 0 && !(g.temperature >= kiln::models::kMinTemperature)) {
    std::ostringstream s;
    s << "--temperature must be 0 (greedy) or at least " << kiln::models::kMinTemperature
      << ", got " << f.at("temperature");
    throw UsageError{s.str()};
  }
  g.top_k = f.contains("top-k") ? parse_int_at_least("top-k", f.at("top-k"), 0) : 0;
  g.top_p = f.contains("top-p") ? parse_double("top-p", f.at("top-p")) : 1.0;
  if (!(g.top_p > 0 && g.top_p <= 1)) {
    throw UsageError{"--top-p must be in (0, 1] (1 = off), got " + f.at("top-p")};
  }
  const uint64_t seed = f.contains("seed") ? parse_uint("seed", f.at("seed")) : 0;
  g.seed = seed;
  if (f.contains("stop")) g.stop_tokens = parse_ids("stop", f.at("stop"));
  const kiln::Device device =
      f.contains("device") ? parse_device(f.at("device")) : kiln::models::default_device();

  // The text's tokenizer: --tokenizer, else the --hf directory's tokenizer.json when it has one,
  // else bytes.
  std::optional<kiln::text::Tokenizer> hf_tokenizer;
  std::string tokenizer_path;
  if (f.contains("tokenizer")) {
    tokenizer_path = f.at("tokenizer");
  } else if (f.contains("hf") && std::filesystem::is_regular_file(
                                     std::filesystem::path(f.at("hf")) / "tokenizer.json")) {
    tokenizer_path = (std::filesystem::path(f.at("hf")) / "tokenizer.json").string();
  }
  if (!tokenizer_path.empty()) hf_tokenizer = kiln::text::Tokenizer::from_file(tokenizer_path);
  const kiln::models::ByteTokenizer bytes;
  std::vector<int64_t> prompt;
  if (!f.contains("text")) {
    prompt = parse_ids("prompt", f.at("prompt"));
  } else if (hf_tokenizer) {
    prompt = hf_tokenizer->encode(f.at("text"));
  } else {
    prompt = bytes.encode(f.at("text"));
  }
  std::optional<kiln::models::GPT> model;
  if (f.contains("checkpoint")) {
    model = kiln::models::load_checkpoint(f.at("checkpoint"), device);
  } else if (f.contains("hf")) {
    model = kiln::models::load_hf_checkpoint(f.at("hf"), kiln::TensorOptions().device(device));
  } else {
    kiln::manual_seed(seed);
    model = kiln::models::GPT(kiln::models::ModelConfig::from_name(f.at("config")),
                              kiln::TensorOptions().device(device));
  }
  (*model)->eval();
  const int64_t vocab = (*model)->config().vocab_size;
  KILN_CHECK(!hf_tokenizer || hf_tokenizer->vocab_size() <= vocab, "[generate] the tokenizer ",
             tokenizer_path, " has ", hf_tokenizer ? hf_tokenizer->vocab_size() : 0,
             " ids, more than the vocab_size ", vocab, " of the model (", (*model)->config().name,
             "): it is another model's tokenizer");
  const int64_t block = (*model)->config().block_size;
  KILN_CHECK(!f.contains("max-new-tokens") || g.max_new_tokens <= block,
             "[generate] --max-new-tokens ", g.max_new_tokens, " exceeds the model's block_size ",
             block, ", the most tokens a sequence can hold");
  const std::vector<int64_t> out = kiln::models::generate(**model, prompt, g);
  std::cout << "prompt:";
  for (int64_t id : prompt) std::cout << " " << id;
  std::cout << "\ngenerated:";
  for (size_t i = prompt.size(); i < out.size(); ++i) std::cout << " " << out[i];
  std::cout << "\n";
  if (f.contains("text") || hf_tokenizer) {
    std::cout << "text:\n"
              << (hf_tokenizer ? hf_tokenizer->decode(out, /*skip_special_tokens=*/true)
                               : bytes.decode_lossy(out))
              << "\n";
  }
  return 0;
}

int cmd_bench(const std::vector<std::string>& args) {
  const Flags f = parse_flags(
      args,
      {"config", "batch", "seq", "steps", "precision", "device", "adam-state", "dist",
       "comm-sm-carveout", "ddp-bucket-mb", "ddp-tail-buckets"},
      {"compile", "no-cuda-graphs", "no-matmul-autotune", "profile", "nccl-all-reduce"});
  if (!f.contains("config")) throw UsageError{"bench needs --config NAME"};
  kiln::models::BenchOptions b;
  b.config_name = f.at("config");
  const auto cfg = kiln::models::ModelConfig::from_name(b.config_name);
  int64_t batch = 8, seq = std::min<int64_t>(256, cfg.block_size);
  if (b.config_name == "llama-160m") batch = 16, seq = 1024;
  if (b.config_name == "llama-3.2-1b") batch = 4, seq = 2048;
  b.batch_size = f.contains("batch") ? parse_int_at_least("batch", f.at("batch"), 1) : batch;
  b.seq_len = f.contains("seq") ? parse_int_at_least("seq", f.at("seq"), 1) : seq;
  check_tokens_per_step(b.batch_size, b.seq_len);
  b.steps = f.contains("steps") ? parse_int_at_least("steps", f.at("steps"), 1) : 10;
  b.compile = f.contains("compile");
  b.cuda_graphs = !f.contains("no-cuda-graphs");
  b.matmul_autotune = !f.contains("no-matmul-autotune");
  b.profile_steps = f.contains("profile") ? 3 : 0;
  if (f.contains("adam-state")) {
    const std::string& s = f.at("adam-state");
    if (s != "f32" && s != "param") {
      throw UsageError{"--adam-state must be f32 or param, got '" + s + "'"};
    }
    b.adam_state_in_param_dtype = s == "param";
  }
  b.device = f.contains("device") ? parse_device(f.at("device")) : kiln::models::default_device();
  b.precision =
      f.contains("precision") ? f.at("precision") : (b.device->is_cuda() ? "bf16-true" : "f32");
  if (f.contains("dist")) b.dist = parse_dist(f.at("dist"));
  if (f.contains("comm-sm-carveout")) {
    if (b.dist != "ddp") throw UsageError{"--comm-sm-carveout goes with --dist ddp"};
    b.comm_sm_carveout =
        static_cast<int>(parse_int_at_least("comm-sm-carveout", f.at("comm-sm-carveout"), 0));
  }
  if (f.contains("nccl-all-reduce")) {
    if (b.dist.empty()) throw UsageError{"--nccl-all-reduce goes with --dist"};
    b.peer_all_reduce = false;
  }
  if (f.contains("ddp-bucket-mb")) {
    if (b.dist != "ddp") throw UsageError{"--ddp-bucket-mb goes with --dist ddp"};
    b.ddp_bucket_mb = parse_double("ddp-bucket-mb", f.at("ddp-bucket-mb"));
    if (*b.ddp_bucket_mb <= 0) {
      throw UsageError{"--ddp-bucket-mb must be positive, got " + f.at("ddp-bucket-mb")};
    }
  }
  if (f.contains("ddp-tail-buckets")) {
    if (b.dist != "ddp") throw UsageError{"--ddp-tail-buckets goes with --dist ddp"};
    b.ddp_tail_buckets = static_cast<int>(std::min<int64_t>(
        parse_int_at_least("ddp-tail-buckets", f.at("ddp-tail-buckets"), 0), 1 << 30));
  }
  const auto r = kiln::models::bench(b, std::cout);
  if (r.rank != 0) return 0;  // rank 0 reports
  std::cout << std::fixed << std::setprecision(1) << "step " << r.step_ms << " ms | "
            << std::setprecision(0) << r.tokens_per_s << " tok/s";
  if (r.world_size > 1) {
    std::cout << " (" << r.tokens_per_s / r.world_size << " per rank, " << r.world_size
              << " ranks)";
  }
  if (r.mfu) std::cout << " | MFU " << std::setprecision(1) << 100 * *r.mfu << "%";
  if (r.peak_memory) {
    std::cout << " | peak GPU memory " << std::setprecision(2)
              << static_cast<double>(*r.peak_memory) / (1 << 30) << " GiB";
  }
  std::cout << " | loss " << std::setprecision(4) << r.final_loss << "\n";
  return 0;
}

int cmd_tokenizer(const std::vector<std::string>& args) {
  if (args.empty() || args[0] != "train") throw UsageError{"usage: kiln tokenizer train [flags]"};
  const Flags f = parse_flags({args.begin() + 1, args.end()},
                              {"data", "vocab-size", "min-frequency", "special", "out"}, {});
  const std::string data = f.contains("data")
                               ? f.at("data")
                               : std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt";
  const std::string out = f.contains("out") ? f.at("out") : "out/tokenizer.json";
  kiln::text::BpeTrainerOptions o;
  if (f.contains("vocab-size")) o.vocab_size = parse_int("vocab-size", f.at("vocab-size"));
  if (f.contains("min-frequency")) {
    o.min_frequency = parse_int("min-frequency", f.at("min-frequency"));
  }
  if (f.contains("special")) {
    o.special_tokens.clear();
    std::stringstream list(f.at("special"));
    for (std::string t; std::getline(list, t, ',');) o.special_tokens.push_back(t);
  }
  KILN_CHECK(!std::filesystem::is_directory(data), "[tokenizer train] --data ", data,
             ": is a directory, not a text file");
  KILN_CHECK(!std::filesystem::is_fifo(data), "[tokenizer train] --data ", data,
             ": is a FIFO, not a regular file");
  std::ifstream in(data, std::ios::binary);
  KILN_CHECK(in.good(), "[tokenizer train] --data ", data, ": cannot open");
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();

  const auto start = std::chrono::steady_clock::now();
  kiln::text::BpeTrainerStats stats;
  const std::string json = kiln::text::train_bpe({text}, o, &stats);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto dir = out.find_last_of('/');
  if (dir != std::string::npos) std::filesystem::create_directories(out.substr(0, dir));
  std::ofstream file(out, std::ios::binary);
  file << json;
  file.close();
  KILN_CHECK(file.good(), "[tokenizer train] cannot write ", out);

  // Read it back as any user would, and check the corpus round trip.
  const auto tok = kiln::text::Tokenizer::from_file(out);
  const std::vector<int64_t> ids = tok.encode(text, /*add_special_tokens=*/false);
  KILN_CHECK(tok.decode(ids, false) == text, "[tokenizer train] ", out,
             ": the corpus does not round-trip");
  std::cout << std::fixed << std::setprecision(2) << "trained on " << data << " (" << text.size()
            << " bytes, " << stats.words << " words, " << stats.unique_words << " distinct) in "
            << seconds << " s\n"
            << "vocab " << tok.vocab_size() << " (" << stats.merges << " merges, "
            << o.special_tokens.size() << " special tokens) -> " << out << "\n"
            << "corpus: " << ids.size() << " tokens, "
            << static_cast<double>(text.size()) / ids.size()
            << " bytes per token, round trip exact\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string command = args.front();
  args.erase(args.begin());
  try {
    if (command == "help" || command == "--help" || command == "-h") {
      parse_flags(args, {}, {});
      std::cout << kUsage;
      return 0;
    }
    if (command == "configs") return cmd_configs(args);
    if (command == "pretrain") return cmd_pretrain(args);
    if (command == "generate") return cmd_generate(args);
    if (command == "bench") return cmd_bench(args);
    if (command == "tokenizer") return cmd_tokenizer(args);
    // The launcher of distributed jobs (dist/launcher.h) parses its own arguments.
    if (command == "run") return kiln::dist::launcher_main(args);
    if (command == "prepare") return kiln::cli::run_prepare_command(args);
    throw UsageError{"unknown command '" + command + "'"};
  } catch (const UsageError& e) {
    std::cerr << "kiln: " << e.message << "\n\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "kiln " << command << ": " << e.what() << "\n";
    return 1;
  }
}
