"""Where a training step's GPU time goes, from the CSV timelines of gpu/kernel_timeline.cpp.

    python3 timeline_report.py [--steps N | --step-ms MS] [--tail F | --last-ms MS] [--top K] [--gaps K]
                               A.csv[.gz] [B.csv[.gz]]

For each timeline: the steady part (the last F of the timeline, default 0.6, or its last MS
milliseconds: a program that compiled for long, as torch.compile, before its timed steps), split into steps
by N, or by the step time MS the program reported, or else by the number of launches of a
kernel that runs once a step (--marker, default `norm_finish`, the end of the gradient clipping's
norm; the steps between its first and last launch; the cross-entropy's kernels run once per chunk
of the LM head).  Per step: the span; the time some compute kernel runs
(the union of their intervals) and the sum of their durations; the same for NCCL's kernels;
the time both run at once; the time NCCL runs alone (communication the step waits for); the
time nothing runs (idle: the host is late); kernel families by time (Triton's generated kernels
are "generated"), and with --top K the K kernels that take most time; with --sequence K, the
last whole step's first K kernels in launch order (one kernel of two programs, layer by layer). With --gaps K: the busiest
stream's busy and idle time, and its K largest kinds of idle gap, each named by the kernels
before and after it (a memset, which the timeline does not hold, or a host that launches late;
under DDP, the wait for the other ranks after the backward). With --api K (timelines recorded
with KILN_TIMELINE_API_US=T): the K host CUDA calls of T us or more that took most time, and those
that ended while the busiest stream idled (the host held up). With two timelines (e.g. one GPU,
then rank 0 of DDP), the kernels whose time per step changed most. Timelines may be gzipped.

With --ranks, the timelines are the ranks of one data-parallel job: per rank, over the whole
steps between the marker's launches that all ranks have (the last ones), the step's span, the
time its compute kernels run on the busiest stream (the rank's own speed) and the idle time
right before the first kernel named by --wait-before (default `norm_partials`, the gradient
norm's first kernel: under DDP, the wait for the last buckets' all-reduce), then how far apart
the ranks' speeds are. DDP runs at its slowest rank's pace; the others wait before the norm.
"""
import argparse
import collections
import csv
import gzip
import re


def load(path, tail, last_ms=0):
    rows = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for r in csv.DictReader(f):
            if r["kind"] == "api":  # the host's calls: api_report reads them
                continue
            rows.append((int(r["start_ns"]), int(r["end_ns"]), int(r["device"]), r["kind"], r["name"],
                         r["stream"]))
    device = collections.Counter(r[2] for r in rows).most_common(1)[0][0]
    rows = [r for r in rows if r[2] == device]
    t0 = min(r[0] for r in rows)
    t1 = max(r[1] for r in rows)
    lo = t1 - last_ms * 1e6 if last_ms else t1 - tail * (t1 - t0)
    return [r for r in rows if r[0] >= lo], t1 - lo


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(u):
    return sum(e - s for s, e in u)


def intersection(a, b):
    i = j = total = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, e - s)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def family(name):
    n = name.lower()
    for key, fam in [("nccl", "nccl"), ("peer_reduce", "peer all-reduce"), ("triton", "generated"),
                     ("gemm", "gemm"), ("sm90_xmma", "gemm"), ("cutlass", "gemm"),
                     ("nvjet", "gemm"), ("flash", "attention"), ("fmha", "attention"),
                     ("cudnn", "attention"), ("adam", "optimizer"),
                     ("cross_entropy", "cross-entropy"), ("norm", "norm"), ("rotary", "rope"),
                     ("glu", "glu"), ("index", "index/embedding"), ("memcpy", "memcpy"),
                     ("copy", "copy"), ("reduce", "reduce"), ("fill", "fill")]:
        if key in n:
            return fam
    return "other"


def report(path, args):
    rows, window = load(path, args.tail, args.last_ms)
    steps = args.steps
    marks = sorted(r[0] for r in rows if args.marker in r[4])
    if not steps and not args.step_ms and len(marks) >= 2:
        # Whole steps only: from the marker's first launch in the steady part to its last.
        rows = [r for r in rows if marks[0] <= r[0] < marks[-1]]
        window, steps = marks[-1] - marks[0], len(marks) - 1
    elif not steps and args.step_ms:
        # The whole steps of that length that end the timeline: a window of 2.1 steps that ends
        # with the optimizer holds three of its launches, which divided by two made AdamW look
        # 1.5x slower than it ran (session 30).
        steps = max(1, int(window / 1e6 / args.step_ms))
        window = int(steps * args.step_ms * 1e6)
        end = max(r[1] for r in rows)
        rows = [r for r in rows if r[0] >= end - window]
    steps = steps or len(marks) or 1
    per = lambda ns: ns / steps / 1e6
    nccl = [r for r in rows if "nccl" in r[4].lower()]
    comp = [r for r in rows if "nccl" not in r[4].lower()]
    uc, un = union([(r[0], r[1]) for r in comp]), union([(r[0], r[1]) for r in nccl])
    ua = union([(r[0], r[1]) for r in rows])
    both = intersection(uc, un)
    print(f"{path}: {per(window * steps):.1f} ms of steady timeline, {steps} steps")
    print(f"  per step (ms): span {per(window):.2f} | compute runs {per(length(uc)):.2f} "
          f"(kernels' sum {per(sum(r[1] - r[0] for r in comp)):.2f}) | NCCL runs {per(length(un)):.2f} "
          f"| both {per(both):.2f} | NCCL alone {per(length(un) - both):.2f} | idle {per(window - length(ua)):.2f}")
    fams = collections.Counter()
    by_name = collections.Counter()
    for r in rows:
        fams[family(r[4])] += r[1] - r[0]
        base, _, grid = r[4].partition(" grid=")  # kernel_timeline.cpp appends the grid
        by_name[re.sub(r"\s+", " ", base)[:90] + (f" grid={grid}" if grid else "")] += r[1] - r[0]
    print("  families (ms per step): " + ", ".join(f"{k} {per(v):.2f}" for k, v in fams.most_common()))
    if args.gemm_tflop and fams["gemm"]:
        print(f"  GEMMs: {args.gemm_tflop:.2f} TFLOP a step in {per(fams['gemm']):.2f} ms = "
              f"{args.gemm_tflop / per(fams['gemm']) * 1e3:.0f} TFLOP/s; at {args.ceiling:.0f} TFLOP/s they "
              f"would take {args.gemm_tflop / args.ceiling * 1e3:.2f} ms")
    for name, ns in by_name.most_common(args.top):
        print(f"    {per(ns):7.3f} ms  {name}")
    if args.gaps:
        gaps(rows, window, steps, args.gaps)
    if args.sequence:
        sequence(rows, window / steps, args.sequence)
    if args.api:
        api_report(path, rows, steps, args.api, args.marker)
    return {k: per(v) for k, v in by_name.items()}


def api_report(path, rows, steps, top, marker):
    """The host's CUDA calls of the steady part (the timeline's api rows, which
    kernel_timeline.cpp writes with KILN_TIMELINE_API_US=T: the calls that took T us or more),
    by time per step; then those that ended while the busiest stream idled 50 us or more at a
    time (the host was held there while the GPU had no work). Whole steps only, from the marker's
    first launch to its last, where it runs twice or more: the end of the timed steps (the loss
    read back, the ranks' results reduced) is no step's."""
    lo, hi = min(r[0] for r in rows), max(r[1] for r in rows)
    marks = sorted(r[0] for r in rows if marker in r[4])
    if len(marks) >= 2:
        lo, hi, steps = marks[0], marks[-1], len(marks) - 1
    rows = [r for r in rows if lo <= r[0] < hi]
    calls = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for r in csv.DictReader(f):
            if r["kind"] == "api" and lo <= int(r["start_ns"]) < hi:
                calls.append((int(r["start_ns"]), int(r["end_ns"]), r["name"], r["stream"]))
    if not calls:
        print("  no host calls in the timeline (record them with KILN_TIMELINE_API_US=T)")
        return
    per = lambda ns: ns / steps / 1e6
    total, count, longest = collections.Counter(), collections.Counter(), collections.Counter()
    for s, e, name, thread in calls:
        key = f"{name} (thread {thread})"
        total[key] += e - s
        count[key] += 1
        longest[key] = max(longest[key], e - s)
    print(f"  host calls recorded in {steps} whole steps (ms per step, calls a step, the longest in us):")
    for key, ns in total.most_common(top):
        print(f"    {per(ns):7.3f} ms  {count[key] / steps:5.1f}  {longest[key] / 1e3:8.1f}  {key}")
    kernels = [r for r in rows if r[3] == "kernel"]
    stream = collections.Counter(r[5] for r in kernels).most_common(1)[0][0]
    busy = union([(r[0], r[1]) for r in kernels if r[5] == stream])
    idle = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= 50_000]
    # A call that ends inside a gap held the host while the GPU had nothing to run: the launches
    # after it came late. One that spans the gap (the host blocked in a full launch queue, or
    # reading a result back) had the host ahead, and says nothing about the gap.
    during = collections.Counter()
    for gs, ge in idle:
        for s, e, name, thread in calls:
            if gs < e <= ge:
                during[f"{name} (thread {thread})"] += e - max(s, gs)
    print(f"  ending while stream {stream} idled 50 us or more at a time "
          f"({per(sum(e - s for s, e in idle)):.3f} ms a step in {len(idle)} gaps in {steps} steps; "
          f"ms per step of the gaps spent in them):")
    for key, ns in during.most_common(top):
        print(f"    {per(ns):7.3f} ms  {key}")


def short_name(name):
    """A mangled C++ kernel's own name (the last of its nested names), else the name."""
    if not name.startswith("_ZN"):
        return name
    i, last = 3, name
    while i < len(name) and name[i].isdigit():
        j = i
        while name[j].isdigit():
            j += 1
        n = int(name[i:j])
        last, i = name[j:j + n], j + n
    return last


def sequence(rows, step_ns, top):
    """The last whole step's first K kernels in launch order: one kernel of two programs, layer
    by layer (kiln's and torch's GEMMs side by side). A step ends with the optimizer's last
    kernel before a pause of 2 ms in them; without an optimizer, the last step_ns of the timeline."""
    kernels = sorted(r for r in rows if r[3] == "kernel")
    opt = [r for r in kernels if re.search(r"adam|multi_tensor", r[4], re.I)]
    ends = [a[1] for a, b in zip(opt, opt[1:]) if b[0] - a[1] > 2e6] + ([opt[-1][1]] if opt else [])
    end = kernels[-1][1]
    lo, hi = (ends[-2], ends[-1]) if len(ends) >= 2 else (end - step_ns, end)
    mine = [r for r in kernels if lo < r[0] and r[1] <= hi]
    print(f"  the last step's kernels in order ({len(mine)} kernels; us, family, name):")
    for s, e, _, _, name, _ in mine[:top]:
        base, _, grid = name.partition(" grid=")
        print(f"    {(e - s) / 1e3:8.1f}  {family(name):15s} {short_name(base)[:70]}"
              f"{' grid=' + grid if grid else ''}")


def gaps(rows, window, steps, top):
    """The busiest stream's busy and idle time per step, and its largest kinds of idle gap."""
    kernels = [r for r in rows if r[3] == "kernel"]
    stream = collections.Counter(r[5] for r in kernels).most_common(1)[0][0]
    mine = sorted((r[0], r[1], r[4].partition(" grid=")[0][:70]) for r in kernels if r[5] == stream)
    busy, last, before = 0, mine[0][0], "(start)"
    by_pair, count = collections.Counter(), collections.Counter()
    for s, e, name in mine:
        if s > last:
            by_pair[(before, name)] += s - last
            count[(before, name)] += 1
        busy += max(0, e - max(s, last))
        if e > last:
            last, before = e, name
    per = lambda ns: ns / steps / 1e6
    print(f"  stream {stream} (ms per step): busy {per(busy):.2f}, idle {per(window - busy):.2f}; "
          f"largest gaps:")
    for (a, b), ns in by_pair.most_common(top):
        # The count in all the steps: a gap seen once (the end of the timed steps, a barrier) is
        # spread over the steps by per(), and must not read as a gap of every step.
        print(f"    {per(ns):7.3f} ms ({count[(a, b)]} in {steps} steps) after {a}  before {b}")


def ranks(paths, args):
    """Per rank of one job: span, compute time and the wait before the norm, per whole step."""
    per_rank = []
    for path in paths:
        rows, _ = load(path, args.tail, args.last_ms)
        kernels = [r for r in rows if r[3] == "kernel"]
        stream = collections.Counter(r[5] for r in kernels).most_common(1)[0][0]
        mine = sorted(r for r in kernels if r[5] == stream)
        marks = [r[0] for r in mine if args.marker in r[4]]
        steps = []
        for a, b in zip(marks, marks[1:]):
            step = [r for r in mine if a <= r[0] < b]
            busy = length(union([(r[0], r[1]) for r in step if "nccl" not in r[4].lower()]))
            first = next((i for i, r in enumerate(step) if args.wait_before in r[4]), 0)
            wait = max(0, step[first][0] - max(r[1] for r in step[:first])) if first else 0
            steps.append((b - a, busy, wait))
        per_rank.append((path, steps))
    n = min(len(s) for _, s in per_rank)
    if n == 0:
        print(f"no whole step between two launches of {args.marker} in every timeline")
        return
    ms = lambda ns: ns / 1e6
    print(f"{len(paths)} ranks, the last {n} whole steps (ms a step): span | compute on the busiest "
          f"stream | idle before {args.wait_before} (mean, min-max)")
    busy = []
    for path, steps in per_rank:
        s = steps[-n:]
        span, work = sum(x[0] for x in s) / n, sum(x[1] for x in s) / n
        waits = [x[2] for x in s]
        busy.append((work, path))
        print(f"  {path}: {ms(span):.2f} | {ms(work):.2f} | {ms(sum(waits) / n):.2f} "
              f"({ms(min(waits)):.2f}-{ms(max(waits)):.2f})")
    (lo, fast), (hi, slow) = min(busy), max(busy)
    print(f"  the ranks' compute differs by {100 * (hi / lo - 1):.1f}%: slowest {slow}, "
          f"fastest {fast}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=0, help="steps: the whole steps of this length that end the steady time")
    ap.add_argument("--marker", default="norm_finish", help="a kernel that runs once a step")
    ap.add_argument("--gemm-tflop", type=float, default=0,
                    help="the cuBLAS GEMMs' TFLOP a step (6 x matmul parameters x tokens)")
    ap.add_argument("--ceiling", type=float, default=775, help="the GEMM ceiling, TFLOP/s")
    ap.add_argument("--tail", type=float, default=0.6)
    ap.add_argument("--last-ms", type=float, default=0, help="the steady part: the last MS ms")
    ap.add_argument("--top", type=int, default=0, help="print the K kernels that take most time")
    ap.add_argument("--gaps", type=int, default=0,
                    help="print the busiest stream's K largest kinds of idle gap")
    ap.add_argument("--sequence", type=int, default=0,
                    help="print the last whole step's first K kernels in launch order")
    ap.add_argument("--api", type=int, default=0,
                    help="print the K host CUDA calls that took most time (the timeline's api rows)")
    ap.add_argument("--ranks", action="store_true",
                    help="the timelines are the ranks of one job: their speeds and waits")
    ap.add_argument("--wait-before", default="norm_partials",
                    help="with --ranks: the kernel before which a rank waits for the others")
    args = ap.parse_args()
    if args.ranks:
        ranks(args.csv, args)
        return
    tables = [report(p, args) for p in args.csv]
    if len(tables) == 2:
        a, b = tables
        diff = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)), reverse=True)
        print("kernels whose time per step grew most (ms, first -> second):")
        for d, k in diff[:15]:
            print(f"  {d:+.3f}  {a.get(k, 0):.3f} -> {b.get(k, 0):.3f}  {k}")
        print("and shrank most:")
        for d, k in diff[-5:]:
            print(f"  {d:+.3f}  {a.get(k, 0):.3f} -> {b.get(k, 0):.3f}  {k}")


if __name__ == "__main__":
    main()
