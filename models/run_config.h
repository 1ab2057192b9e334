// Run configuration files: `kiln pretrain --config run.toml` reads the options of a run from a
// TOML file (the format of torchtitan's train configs), and every run with an out_dir writes its
// effective options as <out_dir>/run.toml beside the checkpoints, so that
// `kiln pretrain --config out/kiln-tiny/run.toml --out out/again` repeats it.
//
//   auto rc = kiln::models::read_run_config("run.toml");       // errors name file:line and key
//   rc.options.max_steps = 50;                                 // a flag overrides the file
//   kiln::models::pretrain(rc.options, std::cout);             // writes out_dir/run.toml
//   std::string text = kiln::models::to_toml(rc.options);      // what run.toml holds
//
// The file (docs/models.md lists every key; all are optional):
//
//   [model]       name, or hf (a Hugging Face checkpoint directory)
//   [data]        path, batch_size, seq_len
//   [training]    steps, precision, device, compile, dist, grad_accum_steps, seed,
//                 skip_nonfinite
//   [optimizer]   lr, weight_decay, betas, eps, grad_clip, adam_state ("f32" | "param")
//   [schedule]    warmup_steps, lr_decay_steps, min_lr
//   [metrics]     log_interval, eval_interval, eval_batches, progress_bar
//   [checkpoint]  out_dir, interval, keep
//
// Strict: an unknown table or key, a value of the wrong type (a float where an integer goes; an
// integer where a float goes is fine) and a value out of range are errors, all of a file's
// reported at once, each naming file:line and the key with its table ("run.toml:7:
// training.steps must be >= 1, got 0"); a TOML syntax error names file:line:column. The file
// holds settings, not actions: --resume and --allow-resume-changes stay flags.
//
// Pitfalls: paths in the file are relative to the working directory, as the flags' are. A
// hand-built PretrainOptions::config is written by its name only; the file of such a run reads
// back only once that config is registered (register_config). toml++ (Debian's
// libtomlplusplus-dev) is included by run_config.cpp only.
#pragma once

#include <set>
#include <string>
#include <string_view>

#include "models/trainer.h"

namespace kiln::models {

// The name of the run configuration that pretrain writes into out_dir.
inline constexpr const char* kRunConfigFile = "run.toml";

struct RunConfig {
  PretrainOptions options;  // the base options with the file's settings applied
  // The keys the file set, with their table ("training.steps"): what a caller layering flags and
  // defaults over the file (`kiln pretrain`) must leave alone.
  std::set<std::string> keys;
  bool has(const std::string& key) const { return keys.contains(key); }
};

// Reads the TOML file at `path` over `base`. Throws kiln::Error "[run_config] <path>:<line>: ..."
// listing every bad key, or "[run_config] <path>: ..." when the file cannot be read.
RunConfig read_run_config(const std::string& path, const PretrainOptions& base = {});
// The same on TOML text; `source` names it in errors (a file name).
RunConfig parse_run_config(std::string_view text, const std::string& source,
                           const PretrainOptions& base = {});

// Every option that the file can hold, as a commented TOML document that parse_run_config reads
// back to the same options (device and progress_bar only when set). Doubles are written in
// their shortest exact form, so the round trip is exact.
std::string to_toml(const PretrainOptions& options);
// Writes to_toml(options) to <dir>/run.toml atomically (temporary file, fsync, rename).
void write_run_config(const std::string& dir, const PretrainOptions& options);

}  // namespace kiln::models
