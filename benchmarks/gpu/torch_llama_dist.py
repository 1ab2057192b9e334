"""PyTorch's side of the data-parallel pretraining comparison (issue 24): tokens per second per
GPU of a Llama-style training step, bf16-true parameters, AdamW(fused=True), under DDP or FSDP2,
eager or compiled.

The model is /work/shared/tools/torch_llama_baseline.py's (plain torch ops: RMSNorm, RoPE, GQA
SDPA, SwiGLU; the loss on float32 logits), with the same llama-160m (16 x 1024 tokens per GPU)
and llama-3.2-1b (4 x 2048, tied embedding) configs, plus mistral-7b (1 x 2048, untied).

    # each case in its own torchrun (isolates an OOM or a hang; a table of all cases at the end):
    python3 benchmarks/gpu/torch_llama_dist.py --nproc-per-node 2 \
        llama-160m:ddp llama-160m:fsdp llama-160m:fsdp-zero2:compile mistral-7b:fsdp ...
    # or all cases in one job:
    torchrun --nproc-per-node 2 benchmarks/gpu/torch_llama_dist.py llama-160m:ddp ...
    # first, a minute's check that every mode trains as one GPU does (a tiny model, float32):
    python3 benchmarks/gpu/torch_llama_dist.py --nproc-per-node 2 --check

A case is CONFIG:MODE[:compile] (or :eager, the default).
  ddp         DistributedDataParallel (device_ids=[LOCAL_RANK], 25 MB buckets; --bucket-view
              sets gradient_as_bucket_view=True)
  fsdp        FSDP2: torch.distributed.fsdp.fully_shard on each block, then on the root,
              reshard_after_forward=True (ZeRO-3)
  fsdp-zero2  the same with reshard_after_forward=False (ZeRO-2)
              (kiln bench --dist's names are aliases: zero3 = fsdp, zero2 = fsdp-zero2; the JSON
              lines carry them as "dist")
  :compile    torch.compile(dynamic=False) of each block, and of the final norm + head +
              cross-entropy (the baseline's compile-loss fusion of the loss), applied before
              DDP / fully_shard wrap the model. This is what works with both wrappers: their hooks
              stay outside the compiled code (FSDP2 wraps the compiled blocks, as torchtitan
              does); under DDP, dynamo's DDPOptimizer splits the compiled graphs at bucket
              boundaries.
Flags: --steps 10 --warmup 3 (timed and warm-up steps), --batch B --seq T (per GPU, for every
case), --bucket-view, --out FILE (append the JSON lines), --case-timeout S (driver: seconds per
case, default 900), --pg-timeout S (seconds a collective waits for the other ranks, default
300), --cpu (CPU tensors over Gloo: a slow smoke test without a GPU, e.g. with the `tiny` config).

Per case: every rank builds the same model (seed 0, bf16 on its GPU), draws its own random
tokens, runs the warm-up steps, resets the peak memory, then times the steps by the wall clock
between two torch.cuda.synchronize(). Rank 0 prints one JSON line
{"impl":"torch","config","mode","world","tok_s_per_gpu","step_ms","peak_mem_gib","loss",...}
(peak_mem_gib: the max over ranks of torch.cuda.max_memory_allocated during the timed steps, as
the baseline measures it; peak_mem_all_gib: the same from the model's creation on, which includes
the first step's allocation of the optimizer state) and a table at the end. An
exception (OOM) becomes a row with "error" and the next case runs; when only some ranks failed,
a collective may hang until NCCL's timeout, which is why the driver (--nproc-per-node) runs each
case in its own torchrun.

--check: for each mode, eager and compiled, 3 AdamW steps of a tiny tied model in float32 (TF32
off) on each rank's part of one global batch, against one unwrapped model trained on the whole
batch on every rank: the losses (averaged over the ranks) must agree to 2e-4 relative.
"""
import argparse
import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    # name: vocab, d, layers, heads, kv_heads, ffn, seq, batch (per GPU), tied
    "llama-160m": dict(vocab=32000, d=768, L=12, H=12, KV=12, ffn=2048, seq=1024, batch=16,
                       tied=False),
    "llama-3.2-1b": dict(vocab=128256, d=2048, L=16, H=32, KV=8, ffn=8192, seq=2048, batch=4,
                         tied=True),
    "mistral-7b": dict(vocab=32000, d=4096, L=32, H=32, KV=8, ffn=14336, seq=2048, batch=1,
                       tied=False),
}
# --check's model, also a case for smoke tests: small, GQA and tied, so that every path of the big
# ones is taken.
TINY = dict(vocab=256, d=64, L=2, H=4, KV=2, ffn=160, seq=32, batch=2, tied=True)
CONFIGS["tiny"] = TINY
MODES = ("ddp", "fsdp", "fsdp-zero2")
# The names of `kiln bench --dist`, accepted as aliases and written as "dist" in the JSON lines.
KILN_DIST = {"ddp": "ddp", "fsdp": "zero3", "fsdp-zero2": "zero2"}
ALIASES = {"zero3": "fsdp", "zero2": "fsdp-zero2"}


# --- The model (torch_llama_baseline.py's, with the loss inside forward) ------------------------

class RMSNorm(nn.Module):
    def __init__(s, d, eps=1e-5):
        super().__init__()
        s.w = nn.Parameter(torch.ones(d))
        s.eps = eps

    def forward(s, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + s.eps)).to(x.dtype) * s.w


def rope_cache(seq, hd, device, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, device=device).float() / hd))
    t = torch.arange(seq, device=device).float()
    f = torch.outer(t, inv)
    f = torch.cat([f, f], -1)
    return f.cos(), f.sin()


def apply_rope(x, cos, sin):
    hd = x.shape[-1]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rot = torch.cat([-x2, x1], -1)
    return (x * cos + rot * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(s, c):
        super().__init__()
        d, H, KV = c["d"], c["H"], c["KV"]
        s.H, s.KV, s.hd = H, KV, d // H
        s.n1 = RMSNorm(d)
        s.n2 = RMSNorm(d)
        s.qkv = nn.Linear(d, (H + 2 * KV) * s.hd, bias=False)
        s.proj = nn.Linear(d, d, bias=False)
        s.fc1 = nn.Linear(d, c["ffn"], bias=False)
        s.fc2 = nn.Linear(d, c["ffn"], bias=False)
        s.out = nn.Linear(c["ffn"], d, bias=False)

    def forward(s, x, cos, sin):
        B, T, D = x.shape
        h = s.n1(x)
        q, k, v = s.qkv(h).split([s.H * s.hd, s.KV * s.hd, s.KV * s.hd], -1)
        q = q.view(B, T, s.H, s.hd).transpose(1, 2)
        k = k.view(B, T, s.KV, s.hd).transpose(1, 2)
        v = v.view(B, T, s.KV, s.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=(s.KV != s.H))
        x = x + s.proj(y.transpose(1, 2).reshape(B, T, D))
        h = s.n2(x)
        return x + s.out(F.silu(s.fc1(h)) * s.fc2(h))


class GPT(nn.Module):
    """forward(idx, targets) -> the mean cross-entropy: the loss is computed inside forward so
    that FSDP2's root unit holds the head's (and a tied embedding's) gathered weight for it."""

    def __init__(s, c, device):
        super().__init__()
        s.c = c
        s.emb = nn.Embedding(c["vocab"], c["d"])
        s.blocks = nn.ModuleList([Block(c) for _ in range(c["L"])])
        s.norm = RMSNorm(c["d"])
        s.head = nn.Linear(c["d"], c["vocab"], bias=False)
        if c["tied"]:
            s.head.weight = s.emb.weight
        cos, sin = rope_cache(c["seq"], c["d"] // c["H"], device)
        s.register_buffer("cos", cos, persistent=False)
        s.register_buffer("sin", sin, persistent=False)

    def forward(s, idx, targets):
        x = s.emb(idx)
        T = idx.shape[1]
        cos, sin = s.cos[:T].to(x.dtype), s.sin[:T].to(x.dtype)
        for b in s.blocks:
            x = b(x, cos, sin)
        return s.head_loss(x, targets)

    def head_loss(s, x, targets):
        logits = s.head(s.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def build(c, dtype, device):
    """The same model on every rank (seed 0), made directly in `dtype` on the GPU."""
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = GPT(c, device)
    finally:
        torch.set_default_dtype(prev)
    return model


def flops_per_token(c, n):
    # The baseline's count: 6N for the dense part + causal attention 6 * L * d * seq.
    return 6 * n + 6 * c["L"] * c["d"] * c["seq"]


# --- Data parallelism ----------------------------------------------------------------------------

def wrap(model, mode, compile_, args, device):
    """Compiles (optionally) and wraps `model` for `mode`; returns the module to call."""
    if compile_:
        for i in range(len(model.blocks)):
            model.blocks[i] = torch.compile(model.blocks[i], dynamic=False)
        model.head_loss = torch.compile(model.head_loss, dynamic=False)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   gradient_as_bucket_view=args.bucket_view)
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    reshard = mode == "fsdp"
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def train_steps(net, opt, batches):
    """One training step per (x, y); returns the last loss (a tensor)."""
    loss = None
    for x, y in batches:
        loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def run_case(name, mode, compile_, args, device):
    c = dict(CONFIGS[name])
    if args.batch:
        c["batch"] = args.batch
    if args.seq:
        c["seq"] = args.seq
    B, T, V = c["batch"], c["seq"], c["vocab"]
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # not the previous case's
    t0 = time.perf_counter()
    model = build(c, torch.bfloat16, device)
    n = sum(p.numel() for p in model.parameters())
    net = wrap(model, mode, compile_, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own tokens
    data = torch.randint(0, V, (args.warmup + args.steps, B, T + 1), device=device, generator=g)
    batches = [(data[i, :, :-1], data[i, :, 1:]) for i in range(data.shape[0])]
    train_steps(net, opt, batches[:args.warmup])
    sync(device)
    warm_s = time.perf_counter() - t0
    peak_warm = torch.cuda.max_memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    sync(device)
    t1 = time.perf_counter()
    loss = train_steps(net, opt, batches[args.warmup:])
    sync(device)
    step_s = (time.perf_counter() - t1) / args.steps
    peak_timed = torch.cuda.max_memory_allocated() if cuda else 0
    peak = torch.tensor([peak_timed, max(peak_warm, peak_timed)], dtype=torch.float64,
                        device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the max over the ranks
    tok_s = B * T / step_s
    fpt = flops_per_token(c, n)
    return dict(params=n, batch=B, seq=T, step_ms=round(step_s * 1e3, 2),
                tok_s_per_gpu=round(tok_s), tok_s=round(tok_s * world),
                tflops_per_gpu=round(fpt * tok_s / 1e12, 1), mfu_989=round(fpt * tok_s / 989e12, 3),
                peak_mem_gib=round(peak[0].item() / 2**30, 2),
                peak_mem_all_gib=round(peak[1].item() / 2**30, 2), warmup_s=round(warm_s, 1),
                loss=round(loss.item(), 4))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        torch._dynamo.reset()  # compiled code and guards of the case, not carried to the next
    except Exception:
        pass


def run_cases(cases, args, device, cpu_group):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for name, mode, compile_ in cases:
        label = mode + (":compile" if compile_ else "")
        row = dict(impl="torch", config=name, mode=label, dist=KILN_DIST[mode], compile=compile_,
                   world=world)
        err = None
        try:
            row.update(run_case(name, mode, compile_, args, device))
        except Exception as e:  # an OOM: a row, then the next case
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"
            traceback.print_exc()
        free_memory()
        # Every rank's outcome, over Gloo (a NCCL collective could queue behind a stuck one).
        errs = [None] * world
        dist.all_gather_object(errs, err, group=cpu_group)
        failed = [f"rank{r}: {e}" for r, e in enumerate(errs) if e is not None]
        if failed:
            row = dict(impl="torch", config=name, mode=label, dist=KILN_DIST[mode],
                       compile=compile_, world=world, error="; ".join(failed)[:600])
        if rank == 0:
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
        rows.append(row)
    return rows


def print_table(rows):
    print("\n%-13s %-19s %5s %10s %9s %11s %11s %7s %6s %8s %7s" % (
        "config", "mode", "world", "batch", "step_ms", "tok/s/gpu", "tok/s", "TFLOP/s", "MFU",
        "mem_GiB", "loss"))
    for r in rows:
        if "error" in r:
            print("%-13s %-19s %5d ERROR %s" % (r["config"], r["mode"], r["world"],
                                                r["error"][:160]))
            continue
        print("%-13s %-19s %5d %10s %9.1f %11d %11d %7.1f %6.3f %8.2f %7.3f" % (
            r["config"], r["mode"], r["world"], f"{r['batch']}x{r['seq']}", r["step_ms"],
            r["tok_s_per_gpu"], r["tok_s"], r["tflops_per_gpu"], r["mfu_989"], r["peak_mem_gib"],
            r["loss"]))
    sys.stdout.flush()


# --- --check -------------------------------------------------------------------------------------

def run_check(args, device):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rank, world = dist.get_rank(), dist.get_world_size()
    c, steps = dict(TINY), 3
    B, T, V = c["batch"], c["seq"], c["vocab"]
    g = torch.Generator(device=device).manual_seed(1234)  # the same global batch on every rank
    data = torch.randint(0, V, (steps, world * B, T + 1), device=device, generator=g)

    def losses_of(net, params, part):
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        out = []
        for i in range(steps):
            d = data[i, rank * B:(rank + 1) * B] if part else data[i]
            loss = train_steps(net, opt, [(d[:, :-1], d[:, 1:])]).detach().clone()
            if part:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            out.append(loss.item())
        return out

    ref_model = build(c, torch.float32, device)
    ref = losses_of(ref_model, ref_model.parameters(), part=False)
    del ref_model
    ok = True
    if rank == 0:
        print(f"check: one GPU on the global batch: losses {', '.join(f'{x:.6f}' for x in ref)}")
    if not abs(ref[-1] - ref[0]) > 1e-3:
        ok = False
        if rank == 0:
            print("check: the reference loss did not move: the check would be vacuous")
    for mode in MODES:
        for compile_ in (False, True):
            label = mode + (":compile" if compile_ else "")
            try:
                model = build(c, torch.float32, device)
                net = wrap(model, mode, compile_, args, device)
                got = losses_of(net, model.parameters(), part=True)
                rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
                good = rel < 2e-4
                msg = f"losses {', '.join(f'{x:.6f}' for x in got)}  max rel diff {rel:.2e}"
                del model, net
            except Exception as e:
                traceback.print_exc()
                good, msg = False, f"{type(e).__name__}: {e}"[:300]
            free_memory()
            ok = ok and good
            if rank == 0:
                print(f"check: {label:<19} {'ok   ' if good else 'WRONG'} {msg}", flush=True)
    return ok


# --- Driver: one torchrun per case ---------------------------------------------------------------

def drive(args, specs, passthrough):
    """Runs each case (or --check) in its own torchrun, echoing its output; returns the rows."""
    rows, ok = [], True
    for spec in (["--check"] if args.check else specs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", os.path.abspath(__file__), spec,
               "--no-table"] + passthrough
        print(f"\n=== {spec}: {' '.join(cmd)}", flush=True)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timed_out = []

        def stop(sig):
            timed_out.append(True)
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass

        # torchrun starts each rank in its own session and stops them on SIGTERM (SIGKILL 30 s
        # later). Our SIGKILL is the last resort, should torchrun hang: it would orphan the ranks.
        timers = [threading.Timer(args.case_timeout, stop, (signal.SIGTERM,)),
                  threading.Timer(args.case_timeout + 120, stop, (signal.SIGKILL,))]
        for t in timers:
            t.start()
        row, errors = None, []
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if "Error" in line and "elastic" not in line:  # the ranks' exceptions
                errors = (errors + [line.strip()])[-2:]
            if line.startswith('{"impl": "torch"'):
                row = json.loads(line)
        rc = p.wait()
        for t in timers:
            t.cancel()
        ok = ok and rc == 0
        if args.check:
            continue
        if row is None:
            name, mode, compile_ = parse_case(spec)
            why = f"timed out after {args.case_timeout} s" if timed_out else f"exit status {rc}"
            why += "".join(": " + e for e in errors)
            row = dict(impl="torch", config=name, mode=mode + (":compile" if compile_ else ""),
                       dist=KILN_DIST[mode], compile=compile_, world=args.nproc_per_node,
                       error=why[:600])
            print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        rows.append(row)
    return rows, ok


# --- Command line --------------------------------------------------------------------------------

def parse_case(spec):
    parts = spec.split(":")
    if len(parts) == 2:
        parts.append("eager")
    if len(parts) == 3:
        parts[1] = ALIASES.get(parts[1], parts[1])
    if (len(parts) != 3 or parts[0] not in CONFIGS or parts[1] not in MODES
            or parts[2] not in ("eager", "compile")):
        raise ValueError(f"bad case '{spec}': expected CONFIG:MODE[:compile] with CONFIG in "
                         f"{', '.join(CONFIGS)} and MODE in {', '.join(MODES)}")
    return parts[0], parts[1], parts[2] == "compile"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", help="CONFIG:MODE[:compile] (default: llama-160m:ddp "
                   "llama-160m:fsdp llama-160m:fsdp-zero2)")
    p.add_argument("--check", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=0, help="per GPU (default: the config's)")
    p.add_argument("--seq", type=int, default=0, help="default: the config's")
    p.add_argument("--bucket-view", action="store_true",
                   help="DDP: gradient_as_bucket_view=True")
    p.add_argument("--out", default="", help="append the JSON lines to this file")
    p.add_argument("--nproc-per-node", type=int, default=0,
                   help="driver: run each case in its own torchrun with this many ranks")
    p.add_argument("--case-timeout", type=int, default=900, help="driver: seconds per case")
    p.add_argument("--pg-timeout", type=int, default=300,
                   help="seconds a collective may wait for the other ranks")
    p.add_argument("--cpu", action="store_true",
                   help="CPU tensors over Gloo: a slow smoke test of the script without a GPU")
    p.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0 or a.batch < 0 or a.seq < 0:
        p.error("--steps must be >= 1, --warmup, --batch and --seq >= 0")
    if not a.cases and not a.check:
        a.cases = ["llama-160m:ddp", "llama-160m:fsdp", "llama-160m:fsdp-zero2"]
    try:
        cases = [parse_case(s) for s in a.cases]
    except ValueError as e:
        p.error(str(e))
    return a, cases


def passthrough_flags(a):
    out = [f"--steps={a.steps}", f"--warmup={a.warmup}"]
    if a.batch:
        out.append(f"--batch={a.batch}")
    if a.seq:
        out.append(f"--seq={a.seq}")
    if a.bucket_view:
        out.append("--bucket-view")
    if a.cpu:
        out.append("--cpu")
    out.append(f"--pg-timeout={a.pg_timeout}")
    return out


def main():
    args, cases = parse_args()
    if "RANK" not in os.environ:
        if args.nproc_per_node < 1:
            sys.exit("torch_llama_dist.py: start it with torchrun --nproc-per-node N, or pass "
                     "--nproc-per-node N to run each case in its own torchrun")
        rows, ok = drive(args, args.cases, passthrough_flags(args))
        if rows:
            print_table(rows)
        sys.exit(0 if ok else 1)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if dist.get_rank() == 0:
        print(json.dumps(dict(torch=torch.__version__, cuda=torch.version.cuda,
                              gpu=torch.cuda.get_device_name() if not args.cpu else "cpu",
                              world=dist.get_world_size())),
              flush=True)
    status = 0
    if args.check:
        status = 0 if run_check(args, device) else 1
    else:
        rows = run_cases(cases, args, device, cpu_group)
        if dist.get_rank() == 0 and not args.no_table:
            print_table(rows)
        if any("error" in r for r in rows):
            status = 1
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()
    sys.exit(status)


if __name__ == "__main__":
    main()
