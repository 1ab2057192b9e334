"""torch.distributed's side of kiln_dist_collectives (benchmarks/dist_collectives.cpp): the
bandwidth of all_reduce, reduce_scatter_tensor and all_gather_into_tensor between the ranks of a
job, in nccl-tests' terms, with the same flags, table and JSON lines ("impl":"torch").

    torchrun --nproc-per-node 2 benchmarks/gpu/torch_collectives.py [--backend nccl|gloo] \
        [--min-bytes 1M] [--max-bytes 1G] [--dtype f32|bf16] [--iters 20] [--warmup 5]

Per op and size (from --min-bytes to --max-bytes, doubling): one checked run (every rank's input
is rank + 1; the result must be 1 + ... + world, or chunk r = r + 1), `warmup` untimed runs, a
barrier, then `iters` runs timed by the wall clock between two torch.cuda.synchronize(). `bytes`
is the whole buffer as nccl-tests counts it (the all-reduced tensor, reduce_scatter's input,
all_gather's output); algbw = bytes / time, busbw = algbw * 2(n-1)/n (all_reduce) or (n-1)/n.
Rank 0 prints the table, then one JSON line per row; join them with kiln's on
(op, dtype, world, bytes).
"""
import argparse
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def parse_bytes(text):
    m = re.fullmatch(r"(\d+)\s*([kmg]?)(i?b)?", text.strip(), re.IGNORECASE)
    if not m or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"cannot read '{text}' as a positive number of bytes (such as 4096, 64K, 1M or 1G)")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got '{text}'")
    return int(text)


def non_negative(text):
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got '{text}'")
    return int(text)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="nccl (default when CUDA is available) or gloo (CPU tensors)")
    p.add_argument("--min-bytes", type=parse_bytes, default=1 << 20)
    p.add_argument("--max-bytes", type=parse_bytes, default=1 << 30)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--iters", type=positive, default=20)
    p.add_argument("--warmup", type=non_negative, default=5)
    a = p.parse_args()
    if a.min_bytes > a.max_bytes:
        p.error(f"--min-bytes ({a.min_bytes}) is above --max-bytes ({a.max_bytes})")
    if a.backend is None:
        a.backend = "nccl" if torch.cuda.is_available() else "gloo"
    return a


def bus_factor(op, n):
    """nccl-tests' factors: busbw is comparable with the links' bandwidth."""
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def main():
    a = parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    elem = 2 if a.dtype == "bf16" else 4
    if a.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    lead = rank == 0

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def run(op, full, chunk):
        if op == "all_reduce":
            dist.all_reduce(full, op=dist.ReduceOp.SUM)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(chunk, full, op=dist.ReduceOp.SUM)
        else:
            dist.all_gather_into_tensor(full, chunk)

    def check(op, full, chunk):
        out = chunk.view(1, -1) if op == "reduce_scatter" else full.view(n, -1)
        lo = out.amin(dim=1).float().cpu().tolist()
        hi = out.amax(dim=1).float().cpu().tolist()
        want = [r + 1.0 if op == "all_gather" else n * (n + 1) / 2.0 for r in range(len(lo))]
        return lo == want and hi == want

    def measure(op, nbytes):
        per_rank = max(1, nbytes // elem // n)  # a whole number of elements per rank
        kw = dict(dtype=dtype, device=dev)
        if op == "all_reduce":
            full, chunk = torch.full((per_rank * n,), rank + 1, **kw), None
        elif op == "reduce_scatter":
            full, chunk = torch.full((per_rank * n,), rank + 1, **kw), torch.empty(per_rank, **kw)
        else:
            full, chunk = torch.empty(per_rank * n, **kw), torch.full((per_rank,), rank + 1, **kw)
        run(op, full, chunk)
        sync()
        ok = check(op, full, chunk)
        if op == "all_reduce":
            full.zero_()  # repeated sums would grow the values to inf
        for _ in range(a.warmup):
            run(op, full, chunk)
        sync()
        dist.barrier()  # the ranks start the timed loop together
        sync()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            run(op, full, chunk)
        sync()
        sec = (time.perf_counter() - t0) / a.iters
        b = per_rank * n * elem
        algbw = b / sec / 1e9
        return dict(bench="collective", impl="torch", backend=a.backend, op=op, dtype=a.dtype,
                    world=n, bytes=b, iters=a.iters, time_us=round(sec * 1e6, 2),
                    algbw_gbs=round(algbw, 3), busbw_gbs=round(algbw * bus_factor(op, n), 3), ok=ok)

    if lead:
        nccl = ""
        if a.backend == "nccl":
            v = torch.cuda.nccl.version()
            nccl = ", nccl " + (".".join(map(str, v)) if isinstance(v, tuple) else str(v))
        print(f"# torch_collectives: backend {a.backend}, world {n}, dtype {a.dtype}, "
              f"iters {a.iters}, warmup {a.warmup}, torch {torch.__version__}{nccl}\n#")
        print("%16s %14s %12s %12s %12s %6s" % ("op", "bytes", "time(us)", "algbw(GB/s)",
                                                "busbw(GB/s)", "check"), flush=True)
    rows = []
    try:
        for op in OPS:
            nbytes = a.min_bytes
            while nbytes <= a.max_bytes:
                r = measure(op, nbytes)
                rows.append(r)
                if lead:
                    print("%16s %14d %12.2f %12.2f %12.2f %6s" % (
                        op, r["bytes"], r["time_us"], r["algbw_gbs"], r["busbw_gbs"],
                        "ok" if r["ok"] else "WRONG"), flush=True)
                nbytes *= 2
    finally:
        if lead:  # the rows measured so far, also after an error
            print()
            for r in rows:
                print(json.dumps(r, separators=(",", ":")))
            sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    if not all(r["ok"] for r in rows):
        print("torch_collectives: some results were WRONG (see the check column)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
