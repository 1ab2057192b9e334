"""Issue 24's scaling share, measured in one run: tokens per second per GPU of `kiln bench` under
data parallelism at N ranks, against each GPU's throughput alone, on the same machine.

    python3 benchmarks/gpu/ddp_scaling.py --kiln build/bin/kiln --gpus 4 --rounds 2 \
        llama-160m llama-3.2-1b
    python3 benchmarks/gpu/ddp_scaling.py --gpus 2 --modes compiled --dist zero2 llama-160m

For each round, config and mode (eager, compiled), in this order (reversed in odd rounds, so that
neither side always runs first on a GPU that is still cool):
  alone   each of the N GPUs as its own job, one after the other (CUDA_VISIBLE_DEVICES=g);
  dist    `kiln run --nproc-per-node N kiln bench ... --dist D` (rank 0's report: tokens per
          second of all ranks over the world size).
Every run is `kiln bench --config C --adam-state param --steps S [--compile]` at the config's
default batch (llama-160m 16 x 1024, llama-3.2-1b 4 x 2048 per GPU; --batch B --seq T sets
another). NCCL_NVLS_ENABLE=0 is set. Without a GPU the ranks run on the CPU over Gloo (the
smoke test in benchmarks/CMakeLists.txt: kiln-tiny, one step).

The table gives the per-rank throughput's share of three baselines: GPU 0 alone (the issue's
"the 1-GPU throughput"), the GPUs' mean alone, and the slowest GPU alone (a synchronous step
runs at the pace of its slowest rank). Each cell is the median over the rounds. --out FILE
appends one JSON line per run. A run that fails or prints no step line is reported with its
last output lines (as is one that exits with another status than 0), the table marks its row
incomplete, and the script exits with 1.
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys

STEP = re.compile(r"step ([0-9.]+) ms \| ([0-9]+) tok/s(?: \(([0-9]+) per rank, ([0-9]+) ranks\))?")
PEAK = re.compile(r"peak GPU memory ([0-9.]+) GiB")


def free_port():
    """A TCP port nothing listens on now (the store of one `kiln run`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bench(args, config, compiled, gpus, dist):
    """One `kiln bench` (under `kiln run` when dist); returns (tok/s per GPU, step ms, peak GiB)."""
    bench = [args.kiln, "bench", "--config", config, "--adam-state", "param",
             "--steps", str(args.steps)] + (["--compile"] if compiled else [])
    if args.batch:
        bench += ["--batch", str(args.batch), "--seq", str(args.seq)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    if dist:
        cmd = [args.kiln, "run", "--nproc-per-node", str(len(gpus)), "--master-port",
               str(args.master_port or free_port()), "--"] + bench + ["--dist", args.dist]
    else:
        cmd = bench
    # GPU g is the g-th of the caller's CUDA_VISIBLE_DEVICES when that is set.
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[g] if g < len(visible) else str(g) for g in gpus)
    rc = None
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        partial = e.stdout or ""
        out = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
        out += f"\n(timed out after {args.timeout} s)"
    m = STEP.search(out)
    if m is None or rc != 0:
        if rc not in (None, 0):
            out += f"\n(exit status {rc})"
        tail = "\n".join(out.strip().splitlines()[-6:])
        print(f"  FAILED: {' '.join(cmd)}\n{tail}", file=sys.stderr)
        return None
    per_gpu = float(m.group(3)) if m.group(3) else float(m.group(2))
    peak = PEAK.search(out)
    return per_gpu, float(m.group(1)), float(peak.group(1)) if peak else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="kiln configs, e.g. llama-160m llama-3.2-1b")
    ap.add_argument("--kiln", default="build/bin/kiln", help="the kiln binary")
    ap.add_argument("--gpus", type=int, default=2,
                    help="ranks: GPUs 0 .. N-1 (of CUDA_VISIBLE_DEVICES, when it is set)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    ap.add_argument("--dist", default="ddp", choices=["ddp", "zero2", "zero3"])
    ap.add_argument("--batch", type=int, help="per GPU (default: the config's, with --seq)")
    ap.add_argument("--seq", type=int, help="with --batch")
    ap.add_argument("--master-port", type=int, help="kiln run's (default: a free port per run)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--out", help="append one JSON line per run to this file")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("eager", "compiled"):
            ap.error(f"--modes: unknown mode {m!r} (eager, compiled)")
    if (args.batch is None) != (args.seq is None):
        ap.error("--batch and --seq go together")
    if args.gpus < 2:
        ap.error(f"--gpus must be at least 2, got {args.gpus}")
    if not os.access(args.kiln, os.X_OK):
        ap.error(f"--kiln: {args.kiln} is not an executable")

    # results[(config, mode)] = {"alone": {gpu: [tok/s ...]}, "dist": [tok/s ...], "peak": [...]}
    results = {}
    failures = 0
    for r in range(args.rounds):
        for config in args.configs:
            for mode in modes:
                cell = results.setdefault((config, mode), {"alone": {}, "dist": [], "peak": []})
                order = ["alone", "dist"] if r % 2 == 0 else ["dist", "alone"]
                for side in order:
                    runs = [[g] for g in range(args.gpus)] if side == "alone" else [list(range(args.gpus))]
                    for gpus in runs:
                        got = run_bench(args, config, mode == "compiled", gpus, side == "dist")
                        label = f"round {r + 1} {config} {mode} " + (
                            f"GPU {gpus[0]} alone" if side == "alone" else f"{args.dist} x {args.gpus}")
                        if got is None:
                            print(f"{label}: failed", flush=True)
                            failures += 1
                            continue
                        tok, ms, peak = got
                        print(f"{label}: {tok:.0f} tok/s per GPU, {ms:.1f} ms a step"
                              + (f", peak {peak:.2f} GiB" if peak is not None else ""), flush=True)
                        if side == "alone":
                            cell["alone"].setdefault(gpus[0], []).append(tok)
                        else:
                            cell["dist"].append(tok)
                            if peak is not None:
                                cell["peak"].append(peak)
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps({"round": r + 1, "config": config, "mode": mode,
                                                    "side": side, "gpus": gpus, "dist": args.dist,
                                                    "tok_s_per_gpu": tok, "step_ms": ms,
                                                    "peak_gib": peak}) + "\n")

    print(f"\n{args.dist} at {args.gpus} GPUs, tok/s per GPU (medians of {args.rounds} rounds)")
    print("| config | mode | GPU 0 alone | mean alone | slowest alone | per rank | share of GPU 0 "
          "| of mean | of slowest | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (config, mode), cell in results.items():
        alone = {g: statistics.median(v) for g, v in cell["alone"].items()}
        if not cell["dist"] or len(alone) < args.gpus:
            print(f"| {config} | {mode} | (incomplete: a run failed) | | | | | | | |")
            continue
        dist = statistics.median(cell["dist"])
        g0, mean, slowest = alone[0], statistics.mean(alone.values()), min(alone.values())
        peak = f"{max(cell['peak']):.2f}" if cell["peak"] else ""
        print(f"| {config} | {mode} | {g0:.0f} | {mean:.0f} | {slowest:.0f} | {dist:.0f} | "
              f"{100 * dist / g0:.1f}% | {100 * dist / mean:.1f}% | {100 * dist / slowest:.1f}% | {peak} |")
    if failures:
        print(f"{failures} run(s) failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
