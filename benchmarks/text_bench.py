#!/usr/bin/env python3
"""The tokenizers library on the text that benchmarks/text_bench.cpp encodes with kiln, and,
given --kiln-bench, kiln's numbers from the same run side by side.

    python3 benchmarks/text_bench.py [--kiln-bench build/benchmarks/kiln_bench] [--repeat 5]

Cases (MB/s of the 1.1 MB corpus, best of --repeat after a warm-up, the library's word cache
warm as kiln's is):
    corpus    tok.encode(corpus) in a process with TOKENIZERS_PARALLELISM=false
    lines     tok.encode(line) for each of the 40,000 lines, same process
    batch/1   tok.encode_batch(lines) with TOKENIZERS_PARALLELISM=false (one thread)
    batch/N   tok.encode_batch(lines) with the library's thread pool (RAYON_NUM_THREADS=N)
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "tinyshakespeare.txt")
FIXTURES = {0: "llama3", 1: "llama2"}  # the Arg of kiln's benchmarks


def lines_of(text):
    return text.splitlines(keepends=True)


def best_of(repeat, f):
    f()  # warm-up: fills the word cache
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def child(mode, repeat):
    """Runs in a subprocess whose environment fixes the library's parallelism."""
    from tokenizers import Tokenizer
    with open(CORPUS, encoding="utf-8") as f:
        corpus = f.read()
    lines = lines_of(corpus)
    mb = len(corpus.encode("utf-8")) / 1e6
    out = {}
    for arg, name in FIXTURES.items():
        tok = Tokenizer.from_file(os.path.join(ROOT, "tests", "text", "data", f"{name}.json"))
        if mode == "single":
            out[f"corpus/{arg}"] = mb / best_of(repeat, lambda: tok.encode(corpus, add_special_tokens=False))
            out[f"lines/{arg}"] = mb / best_of(
                repeat, lambda: [tok.encode(line, add_special_tokens=False) for line in lines])
            out[f"batch/{arg}/1"] = mb / best_of(
                repeat, lambda: tok.encode_batch(lines, add_special_tokens=False))
        else:
            threads = os.environ["RAYON_NUM_THREADS"]
            out[f"batch/{arg}/{threads}"] = mb / best_of(
                repeat, lambda: tok.encode_batch(lines, add_special_tokens=False))
    print(json.dumps(out))


def run_child(mode, repeat, env_extra):
    env = dict(os.environ, **env_extra)
    res = subprocess.run([sys.executable, __file__, "--child", mode, "--repeat", str(repeat)],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def kiln_numbers(binary):
    res = subprocess.run([binary, "--benchmark_filter=Tokenizer", "--benchmark_min_time=0.5",
                          "--benchmark_format=json"], check=True, capture_output=True, text=True)
    out = {}
    for b in json.loads(res.stdout)["benchmarks"]:
        # BM_TokenizerLines/0/real_time -> lines/0; BM_TokenizerBatch/0/2/real_time -> batch/0/2
        parts = b["name"].split("/")
        kind = parts[0].replace("BM_Tokenizer", "").lower()
        out["/".join([kind] + parts[1:-1])] = b["bytes_per_second"] / 1e6
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kiln-bench", help="kiln_bench binary to run beside the library")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--child", choices=["single", "parallel"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.repeat)
        return
    lib = run_child("single", args.repeat, {"TOKENIZERS_PARALLELISM": "false"})
    lib.update(run_child("parallel", args.repeat, {"TOKENIZERS_PARALLELISM": "true",
                                                   "RAYON_NUM_THREADS": str(args.threads)}))
    kiln = kiln_numbers(args.kiln_bench) if args.kiln_bench else {}
    import tokenizers
    print(f"tokenizers {tokenizers.__version__}, {os.cpu_count()} cores; MB/s of the corpus "
          f"({os.path.getsize(CORPUS) / 1e6:.2f} MB)")
    print(f"{'case':<22}{'tokenizers':>12}{'kiln':>10}{'kiln/lib':>10}")
    for key in sorted(set(lib) | set(kiln)):
        arg = int(key.split("/")[1])
        name = f"{key} ({FIXTURES[arg]})"
        a, b = lib.get(key), kiln.get(key)
        ratio = f"{b / a:.2f}x" if a and b else ""
        print(f"{name:<22}{a or float('nan'):>12.2f}{b or float('nan'):>10.2f}{ratio:>10}")


if __name__ == "__main__":
    main()
