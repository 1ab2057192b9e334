"""PyTorch timings of the operations kiln_gpu_bench times, for a side-by-side table.

Memory-bound rows also print their fraction of the device-to-device copy measured in the same
run (the kiln column against kiln's copy, the torch one against torch's).

    kiln_gpu_bench kiln.json && python3 benchmarks/gpu/torch_reference.py --kiln kiln.json \
        --out torch.json

Same method as the kiln harness: fresh random inputs (never zeros), warm-up, a sleep kernel
queued first so that the host enqueues every sample before the GPU reaches them, CUDA events
around each sample, the median of 20. Memory-bound cases rotate among 4 input sets. With
--kiln, prints both columns and kiln / PyTorch speed ratios (> 1: kiln faster).
"""
import argparse
import contextlib
import json

import torch
import torch.nn.functional as F

SAMPLES = 20
DEV = "cuda"


def time_ms(fn, reps=1, setup=None):
    """Median GPU ms of fn(i); setup(i) (untimed, queued before the start event) may prepare."""
    for i in range(3):
        if setup:
            setup(i)
        fn(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(SAMPLES)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(SAMPLES)]
    torch.cuda._sleep(200_000_000)
    call = 0
    for s in range(SAMPLES):
        if setup:
            setup(call)
        starts[s].record()
        for _ in range(reps):
            fn(call)
            call += 1
        stops[s].record()
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) / reps for a, b in zip(starts, stops))
    return 0.5 * (ms[SAMPLES // 2 - 1] + ms[SAMPLES // 2])


rows = []
copy_gbs = [0.0]  # the measured device-to-device copy, the bandwidth ceiling


def report(name, ms, flops=0.0, nbytes=0.0):
    r = {"name": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else 0.0,
         "gbs": nbytes / ms / 1e6 if nbytes else 0.0}
    r["copy_frac"] = r["gbs"] / copy_gbs[0] if copy_gbs[0] else 0.0
    rows.append(r)
    line = f"{name:<34} {ms:10.4f} ms"
    if flops:
        line += f"  {r['tflops']:8.1f} TFLOP/s"
    if nbytes:
        line += f"  {r['gbs']:8.1f} GB/s"
    if nbytes and copy_gbs[0]:
        line += f"  {100 * r['copy_frac']:5.1f}% of copy"
    print(line, flush=True)


def rand(*shape, dtype=torch.bfloat16, scale=1.7):
    return ((torch.rand(*shape, device=DEV, dtype=torch.float32) * 2 - 1) * scale).to(dtype)


def bench_gemm(name, m, n, k, backward=True):
    x, w = rand(m, k), rand(n, k)
    flops = 2.0 * m * n * k
    base = f"gemm {name} {m}x{n}x{k}"
    report(base + " fwd", time_ms(lambda i: torch.mm(x, w.t())), flops)
    if not backward:
        return
    dy = rand(m, n)
    report(base + " dgrad", time_ms(lambda i: torch.mm(dy, w)), flops)
    report(base + " wgrad", time_ms(lambda i: torch.mm(dy.t(), x)), flops)


def bench_flash_attention():
    """Causal SDPA at the Llama training shapes, Mistral-7B's attention (head size 128) and
    gemma-2b's (head size 256) at 1b's tokens (kiln: bench_flash_attention in gpu_bench.cu; same
    FLOP counts: fwd 4 B H T^2 D / 2, bwd 2.5x). Each shape on torch's default backend (cuDNN's
    SDPA on Hopper: the row kiln's dispatcher is compared with), then on cuDNN (" [cudnn]",
    against kiln's own call of cuDNN) and on torch's flash backend (" [torch flash]"). The
    "... qkv" shapes lay the operands out as a training step does: q, k, v head views of one
    [B, T, (H + 2 G) D] projection, dO a [B, T, H D] product viewed [B, H, T, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    shapes = [("160m", 16, 12, 12, 1024, 64, False), ("160m qkv", 16, 12, 12, 1024, 64, True),
              ("1b", 4, 32, 8, 2048, 64, False), ("1b qkv", 4, 32, 8, 2048, 64, True),
              ("7b", 4, 32, 8, 2048, 128, False), ("g2b", 4, 8, 1, 2048, 256, False)]
    backends = [("", None), (" [cudnn]", SDPBackend.CUDNN_ATTENTION),
                (" [torch flash]", SDPBackend.FLASH_ATTENTION)]
    for name, b, h, hkv, t, d, views in shapes:
        if views:
            qkv = rand(b, t, (h + 2 * hkv) * d).requires_grad_(True)
            qs, ks, vs = qkv.split([h * d, hkv * d, hkv * d], -1)
            q = qs.view(b, t, h, d).transpose(1, 2)
            k = ks.view(b, t, hkv, d).transpose(1, 2)
            v = vs.view(b, t, hkv, d).transpose(1, 2)
            dout = rand(b, t, h * d).view(b, t, h, d).transpose(1, 2)
        else:
            q = rand(b, h, t, d).requires_grad_(True)
            k = rand(b, hkv, t, d).requires_grad_(True)
            v = rand(b, hkv, t, d).requires_grad_(True)
            dout = rand(b, h, t, d)
        flops = 4.0 * b * h * t * t * d / 2
        gqa = h != hkv
        for label, backend in backends:
            ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            with ctx:
                try:
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                except RuntimeError as e:  # this backend does not take the call
                    print(f"  (sdpa {name}{label}: not taken: {str(e).splitlines()[0][:80]})")
                    continue
                with torch.no_grad():
                    report(f"sdpa causal {name} fwd{label}",
                           time_ms(lambda i: F.scaled_dot_product_attention(
                               q, k, v, is_causal=True, enable_gqa=gqa)), flops)
                outs = {}

                def setup(i):
                    outs[i] = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=gqa)

                def bwd(i):  # the gradients of q, k, v (views or leaves): SDPA's backward alone
                    torch.autograd.grad(outs.pop(i), (q, k, v), dout)

                report(f"sdpa causal {name} bwd{label}", time_ms(bwd, setup=setup), 2.5 * flops)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x, cos, sin):
    """Hugging Face Llama's apply_rotary_pos_emb for one tensor (eager)."""
    return x * cos + rotate_half(x) * sin


def bench_rope(b, name):
    """llama-3.2-1b (B 4; 16: the large size): q and k as [B, H, T, D] views of one qkv
    projection, bf16 tables."""
    t, hq, hkv, d = 2048, 32, 8, 64
    qs, ks = [], []
    for _ in range(3):
        qkv = rand(b, t, (hq + 2 * hkv) * d)
        qs.append(qkv[..., :hq * d].view(b, t, hq, d).transpose(1, 2))
        ks.append(qkv[..., hq * d:(hq + hkv) * d].view(b, t, hkv, d).transpose(1, 2))
    cos, sin = rand(t, d), rand(t, d)
    nbytes = 2.0 * (hq + hkv) * b * t * d * 2
    with torch.no_grad():
        report(f"rope {name} q+k bf16 fwd",
               time_ms(lambda i: (rope(qs[i % 3], cos, sin), rope(ks[i % 3], cos, sin))),
               nbytes=nbytes)
    # Backward: autograd through the same ops, from contiguous leaves.
    ql = [rand(b, hq, t, d).requires_grad_(True) for _ in range(3)]
    kl = [rand(b, hkv, t, d).requires_grad_(True) for _ in range(3)]
    dq, dk = rand(b, hq, t, d), rand(b, hkv, t, d)
    outs = {}

    def setup(i):
        outs[i] = (rope(ql[i % 3], cos, sin), rope(kl[i % 3], cos, sin))

    def bwd(i):
        torch.autograd.grad(outs.pop(i), (ql[i % 3], kl[i % 3]), (dq, dk))

    report(f"rope {name} q+k bf16 bwd", time_ms(bwd, setup=setup), nbytes=nbytes)


def bench_glu():
    n = f = 8192
    gate = rand(n, f, scale=4.0).requires_grad_(True)
    up = rand(n, f).requires_grad_(True)
    dy = rand(n, f)
    tb = n * f * 2.0
    for name, act in [("swiglu", F.silu), ("geglu_tanh", lambda g: F.gelu(g, approximate="tanh"))]:
        with torch.no_grad():
            report(f"{name} 8192x8192 bf16 fwd", time_ms(lambda i: act(gate) * up), nbytes=3 * tb)
        outs = {}

        def setup(i):
            outs[i] = act(gate) * up

        def bwd(i):
            torch.autograd.grad(outs.pop(i), (gate, up), dy)

        report(f"{name} 8192x8192 bf16 bwd", time_ms(bwd, setup=setup), nbytes=5 * tb)


def bench_generic():
    n = 64 << 20
    for dt, tn in [(torch.bfloat16, "bf16"), (torch.float32, "f32")]:
        eb = torch.tensor([], dtype=dt).element_size()
        a, b = rand(n, dtype=dt), rand(n, dtype=dt)
        report(f"add 64M {tn}", time_ms(lambda i: torch.add(a, b)), nbytes=3.0 * n * eb)
        report(f"mul 64M {tn}", time_ms(lambda i: torch.mul(a, b)), nbytes=3.0 * n * eb)
        m = a.view(8192, 8192)
        report(f"sum rows 8192x8192 {tn}", time_ms(lambda i: m.sum(dim=1)), nbytes=1.0 * n * eb)
        report(f"sum all 64M {tn}", time_ms(lambda i: a.sum()), nbytes=1.0 * n * eb)
        report(f"sum columns 8192x8192 {tn}", time_ms(lambda i: m.sum(dim=0)), nbytes=1.0 * n * eb)
        g = a[: 8192 * 2048].view(8192, 2048)
        report(f"sum columns 8192x2048 {tn}", time_ms(lambda i: g.sum(dim=0)),
               nbytes=8192.0 * 2048 * eb)
        del a, b, m, g
    x = rand(8192, 32768, scale=8.0)
    report("softmax 8192x32768 bf16", time_ms(lambda i: torch.softmax(x, dim=-1)),
           nbytes=2.0 * x.numel() * x.element_size())


def llama_1b_shapes():
    """The parameter shapes of llama-3.2-1b (tied embedding), as kiln_gpu_bench's AdamW case."""
    shapes = [(128256, 2048), (2048,)]
    for _ in range(16):
        shapes += [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048),
                   (8192, 2048), (2048, 8192), (2048,), (2048,)]
    return shapes


def bench_adamw(dtype, name, nbytes_per_param):
    """torch.optim.AdamW(fused=True) over 1.24 B parameters. torch keeps the state in the
    parameter's dtype: f32 parameters move 28 B each (p, g, m, v read; p, m, v written), bf16
    parameters 14 B (bf16 moments). nbytes_per_param is the count of the kiln row of the same
    name: "adamw 1.24B bf16 params" is kiln with f32 state (22 B), which torch has no fused
    equivalent of, so torch's row there is its bf16-state step counted at 22 B (its GB/s column
    overstates its traffic; compare times knowing torch moves less); "adamw 1.24B bf16 params
    bf16 state" is like for like (kiln's state_in_param_dtype, 14 B on both sides)."""
    params = []
    for s in llama_1b_shapes():
        p = rand(*s, dtype=dtype, scale=0.5).requires_grad_(True)
        p.grad = rand(*s, dtype=dtype, scale=1e-2)
        params.append(p)
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    report(name, time_ms(lambda i: opt.step()), nbytes=nbytes_per_param * n)
    del opt, params
    torch.cuda.empty_cache()


def llama_160m_shapes():
    """llama-160m-like gradients (768 hidden, 3072 MLP, 12 layers, tied 32000 vocab), as
    kiln_gpu_bench's clip case."""
    shapes = [(32000, 768), (768,)]
    for _ in range(12):
        shapes += [(768, 768), (768, 768), (768, 768), (768, 768), (3072, 768), (3072, 768),
                   (768, 3072), (768,), (768,)]
    return shapes


def bench_clip(shapes, model):
    """Gradient clipping of bf16 gradient lists, the rows of kiln_gpu_bench's clip section: the
    per-tensor loop, torch._foreach_norm + stack + torch._foreach_mul_ (kiln's foreach row), each
    foreach op alone, and torch.nn.utils.clip_grad_norm_(foreach=True) (no item(): torch returns
    the norm as a tensor; kiln's row of that name includes its one item())."""
    max_norm = 1e-3
    grads = [rand(*s, dtype=torch.bfloat16, scale=1e-2) for s in shapes]
    n = sum(g.numel() for g in grads)
    base = f"clip {model} bf16 "

    def per_tensor(i):
        norms = [g.norm(2.0).to(torch.float64) for g in grads]
        total = torch.stack(norms).square().sum().sqrt()
        coef = (max_norm / (total + 1e-6)).clamp_max(1.0)
        for g in grads:
            g.mul_(coef)

    def foreach(i):
        total = torch.stack(torch._foreach_norm(grads)).to(torch.float64).square().sum().sqrt()
        torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp_max(1.0))

    scale = torch.tensor(0.999, dtype=torch.float64, device=DEV)
    params = []
    for g in grads:
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g
        params.append(p)
    with torch.no_grad():
        report(base + "per-tensor (norm, stack, mul_)", time_ms(per_tensor), nbytes=6.0 * n)
        report(base + "foreach (foreach_norm, stack, foreach_mul_)", time_ms(foreach),
               nbytes=6.0 * n)
        report(base + "foreach_norm alone", time_ms(lambda i: torch._foreach_norm(grads)),
               nbytes=2.0 * n)
        report(base + "foreach_mul_ alone", time_ms(lambda i: torch._foreach_mul_(grads, scale)),
               nbytes=4.0 * n)
        report(base + "nn::utils::clip_grad_norm_ (one item())",
               time_ms(lambda i: torch.nn.utils.clip_grad_norm_(
                   params, max_norm * 0.9 ** i, foreach=True)), nbytes=6.0 * n)
    del grads, params
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", help="kiln_gpu_bench's JSON, for the side-by-side table")
    ap.add_argument("--out", help="write PyTorch's results as JSON")
    ap.add_argument("--no-gemm", action="store_true", help="skip the GEMMs")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}")

    nbytes = 1 << 30
    a, b = rand(nbytes // 2), rand(nbytes // 2)
    report("d2d copy 1GiB", time_ms(lambda i: b.copy_(a)), nbytes=2.0 * nbytes)
    copy_gbs[0] = rows[-1]["gbs"]
    del a, b

    gemms = [] if args.no_gemm else [
        ("ref", 8192, 8192, 8192, False)]
    for g in gemms:
        bench_gemm(*g)
    for g in [] if args.no_gemm else [("1b-qkv", 8192, 3072, 2048), ("1b-attn_out", 8192, 2048, 2048),
              ("1b-gate_up", 8192, 16384, 2048), ("1b-down", 8192, 2048, 8192),
              ("1b-head", 8192, 128256, 2048), ("160m-qkv", 16384, 2304, 768),
              ("160m-gate_up", 16384, 4096, 768), ("160m-down", 16384, 768, 2048),
              ("160m-head", 16384, 32000, 768)]:
        bench_gemm(*g)
    if not args.no_gemm:
        bench_gemm("ref2", 8192, 8192, 8192, backward=False)

    for rows_, d in [(8192, 2048), (32768, 4096)]:
        w = rand(d).requires_grad_(True)
        xs = [rand(rows_, d).requires_grad_(True) for _ in range(4)]
        dys = [rand(rows_, d) for _ in range(4)]
        tb = rows_ * d * 2.0
        shape = f"{rows_}x{d}"
        dst = torch.empty_like(xs[0])
        with torch.no_grad():
            report(f"d2d copy {shape} bf16", time_ms(lambda i: dst.copy_(xs[i % 4])),
                   nbytes=2 * tb)
        report(f"rmsnorm {shape} bf16 fwd",
               time_ms(lambda i: F.rms_norm(xs[i % 4], (d,), w, 1e-6)), nbytes=2 * tb)
        ys = {}

        def rms_setup(i):
            ys[i] = F.rms_norm(xs[i % 4], (d,), w, 1e-6)

        def rms_bwd(i):
            torch.autograd.grad(ys.pop(i), (xs[i % 4], w), dys[i % 4])

        report(f"rmsnorm {shape} bf16 bwd", time_ms(rms_bwd, setup=rms_setup), nbytes=3 * tb)
        del xs, dys, ys, dst

    for rows_, d in [(8192, 2048), (32768, 4096)]:
        w = rand(d).requires_grad_(True)
        b = rand(d).requires_grad_(True)
        xs = [rand(rows_, d).requires_grad_(True) for _ in range(4)]
        dys = [rand(rows_, d) for _ in range(4)]
        tb = rows_ * d * 2.0
        shape = f"{rows_}x{d}"
        with torch.no_grad():
            report(f"layernorm {shape} bf16 fwd",
                   time_ms(lambda i: F.layer_norm(xs[i % 4], (d,), w, b, 1e-5)), nbytes=2 * tb)
        ys = {}

        def ln_setup(i):
            ys[i] = F.layer_norm(xs[i % 4], (d,), w, b, 1e-5)

        def ln_bwd(i):
            torch.autograd.grad(ys.pop(i), (xs[i % 4], w, b), dys[i % 4])

        report(f"layernorm {shape} bf16 bwd", time_ms(ln_bwd, setup=ln_setup), nbytes=3 * tb)
        del xs, dys, ys

    n, v = 8192, 128256
    logits = rand(n, v, scale=8.0).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device=DEV)
    cb = n * v * 2.0
    print(f"  (cross-entropy loss on uniform[-8, 8) logits: "
          f"{F.cross_entropy(logits.float(), targets).item():.4f})")
    for label, prep in [("", lambda t: t), (" upcast-f32", lambda t: t.float())]:
        with torch.no_grad():
            report(f"cross_entropy 8192x128256 bf16{label} fwd",
                   time_ms(lambda i: F.cross_entropy(prep(logits), targets)), nbytes=cb)
        losses = {}

        def ce_setup(i):
            losses[i] = F.cross_entropy(prep(logits), targets)

        def ce_bwd(i):
            torch.autograd.grad(losses.pop(i), logits)

        report(f"cross_entropy 8192x128256 bf16{label} bwd", time_ms(ce_bwd, setup=ce_setup),
               nbytes=2 * cb)

    bench_flash_attention()
    bench_rope(4, "1b")
    bench_rope(16, "1b x4")
    bench_glu()
    bench_generic()
    del logits
    torch.cuda.empty_cache()
    bench_clip(llama_160m_shapes(), "llama-160m")
    bench_clip(llama_1b_shapes(), "llama-3.2-1b")
    bench_adamw(torch.float32, "adamw 1.24B f32", 28.0)
    bench_adamw(torch.bfloat16, "adamw 1.24B bf16 params", 22.0)
    bench_adamw(torch.bfloat16, "adamw 1.24B bf16 params bf16 state", 14.0)

    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "results": rows}, f, indent=1)
    if args.kiln:
        with open(args.kiln) as f:
            kiln = {r["name"]: r for r in json.load(f)["results"]}
        torch_rows = {r["name"]: r for r in rows}
        ref = max([r["tflops"] for n_, r in kiln.items() if n_.startswith("gemm ref")] + [0.0])
        kiln_copy = kiln["d2d copy 1GiB"]["gbs"] if "d2d copy 1GiB" in kiln else 0.0
        print(f"\n{'case':<34} {'kiln ms':>9} {'torch ms':>9} {'kiln/torch speed':>16}  kiln rate")
        names = list(kiln) + [n for n in torch_rows if n not in kiln]
        for name in names:
            k = kiln.get(name)
            t = torch_rows.get(name)
            ks = f"{k['ms']:9.4f}" if k else f"{'-':>9}"
            ts = f"{t['ms']:9.4f}" if t else f"{'-':>9}"
            ratio = f"{t['ms'] / k['ms']:16.2f}" if k and t else f"{'-':>16}"
            rate = ""
            if k and k["tflops"]:
                rate = f"{k['tflops']:.0f} TFLOP/s"
                if ref > 1e-6:  # the 8192^3 reference is not run with --no-gemm
                    rate += f" ({100 * k['tflops'] / ref:.0f}% of 8192^3)"
            elif k and k["gbs"]:
                rate = f"{k['gbs']:.0f} GB/s"
                if kiln_copy and name != "d2d copy 1GiB":
                    rate += f" ({100 * k['gbs'] / kiln_copy:.0f}% of copy"
                    if t and copy_gbs[0]:
                        rate += f"; torch {100 * t['gbs'] / copy_gbs[0]:.0f}%"
                    rate += ")"
            print(f"{name:<34} {ks} {ts} {ratio}  {rate}")


if __name__ == "__main__":
    main()
