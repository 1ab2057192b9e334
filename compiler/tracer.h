// The tracer: runs a callable once on proxy tensors (shape, dtype and device, no memory) and
// records every op it dispatches as a bound op of a Trace (compiler/trace.h).
//
// How it sees the op stream: a handler at the dispatcher's Trace key (the top of the chain)
// records each call the callable makes, then runs it below the key in proxy mode
// (tensor/registry.h: ProxyModeGuard), so autocast and autograd behave as in eager code and
// the outputs are proxies; each bound op keeps the autocast state it ran under. Functional calls
// made inside a recorded call are recorded too, before it: autocast's casts (which the replayed
// outer op repeats, so dce drops them) and the copy autograd keeps of an in-place op's input
// (which only the traced backward reads). A fused op that no kernel of its device supports is
// traced as its decomposition, as eager code runs it. backward() inside the callable runs the
// registered backward rules on proxies, so their ops are recorded too, and optimizer.step()
// records the optimizer-update op. zeros() / full() record an `empty` op while tracing
// (tensor/traced_factories.h), so buffers they make are proxies like every other value.
//
// What enters the trace as an input:
//   - the callable's tensor arguments, as proxies made by the tracer (values a0, a1, ...);
//   - every other real tensor the callable's ops read (parameters, buffers, optimizer state,
//     constants it captured): an "external" (p0, p1, ...), by identity. While tracing, the
//     tensor itself is turned into a proxy (TensorImpl::set_data), so that every handle to it,
//     p.grad() included, sees the traced state; all of it is restored when tracing ends. A
//     tensor over borrowed memory (from_blob) is copied when captured: the program reads the
//     copy. Other tensors made from host values inside the callable are constants by identity.
//
// What the callable leaves behind is recorded as well: the .grad of each external after the
// call (backward() and zero_grad() set them) as grad effects, and the proxies that outlived the
// call in the callable's own state (a lazily created optimizer state) as escapes: the caller
// runs the program once to give them real values, and traces again on the next call.
//
// Random ops: the Philox offsets they reserved become offsets from the program's base, which
// every run reserves afresh, so a compiled program draws what eager code would have drawn. The
// global generator is left as it was before tracing.
//
// Reading values while tracing (item(), printing, data_ptr(), an op whose output shape depends
// on data such as nonzero) fails with an error that names the op and says what to do instead.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "compiler/trace.h"

namespace kiln::compiler {

// The callable as the tracer runs it: proxies of the tensor arguments in, tensors out.
using TraceBody = std::function<std::vector<Tensor>(const std::vector<Tensor>& arguments)>;

struct TraceResult {
  Trace trace;
  // The captured tensors, real again, in the order of Trace::externals.
  std::vector<Tensor> externals;
  // Proxies still held by the callable's state after it returned, and their values: the
  // caller gives each the real tensor of its value (TensorImpl::set_data) after running.
  std::vector<std::pair<std::weak_ptr<TensorImpl>, int>> escaped;
  // Per external: whether the program depends on whether it had a grad when called (see
  // Tracer::restore); the cache guards that only for these.
  std::vector<bool> grad_guarded;

  // Joint mode (see trace_callable): the ops from `backward_begin` on are the backward of the
  // ops before it. `grad_outputs` has one value per output of the callable: the proxy gradient
  // that the backward reads for it (-1: the output is not differentiable). `grad_targets`
  // lists what is differentiated (argument and external values that require grad) and
  // `grads` their gradients (-1: the outputs do not depend on it).
  int backward_begin = -1;
  std::vector<int> grad_outputs;
  std::vector<int> grad_targets;
  std::vector<int> grads;
};

// Traces `body` on proxies of `arguments`. Not reentrant: tracing inside a traced callable is
// an error. With `joint`, when grad mode is on, the callable ran no backward of its own and
// some of its outputs require grad, the backward of those outputs with respect to every
// argument and captured tensor that requires grad is traced as well, after the forward ops
// (the joint trace that compile() splits into a forward and a backward program).
TraceResult trace_callable(const TraceBody& body, const std::vector<Tensor>& arguments,
                           const std::string& fn_name = "fn", bool joint = false);

// Whether this thread is tracing now (for errors that should name the compiler).
bool is_tracing();

// While one lives, this thread runs as if it were not tracing: ops run on real tensors and are
// not recorded, and is_tracing() is false. For state that a traced callable sets up once, apart
// from the program it records (DDP's buckets rebuilt in the order the traced backward made the
// gradients ready, dist/ddp.cpp): such tensors are real, and the trace reads them as captured
// tensors. Nothing made under it may depend on a traced value.
class NotTracing {
 public:
  NotTracing();
  ~NotTracing();
  NotTracing(const NotTracing&) = delete;
  NotTracing& operator=(const NotTracing&) = delete;

 private:
  void* saved_;
};

// A proxy tensor (no memory: StorageImpl::is_proxy) of `spec`'s sizes, strides (contiguous when
// empty), dtype and device.
Tensor proxy_of(const TensorSpec& spec, bool requires_grad = false);

// For code that points a tensor at other data while tracing (TensorImpl::set_data), as FSDP points
// its parameters at the gathered full tensors and back (dist/fsdp.cpp; docs/distributed.md,
// "Compiled FSDP"). Each is a no-op when this thread is not tracing.
// Captures `t` now when it is a real tensor (an external, by identity), before its data is
// swapped: the trace then restores the data it has now when tracing ends.
void trace_capture_now(const Tensor& t);
// After `t`'s data was swapped: the tracer forgets the value it knew `t` by, and the next read
// of `t` finds its value by its new data (the op output it is a view of, or an external).
void trace_forget_handle(const Tensor& t);
// `to`, a traced value laid out over a whole proxy storage from offset 0, now holds what the
// proxy storage `from` held: from here on a tensor on `from` (a view autograd saved in the
// forward) reads as an as_strided view of `to` at the same sizes, strides and offset, recorded
// where it is first read. FSDP's gather in backward, a new value, so that the forward's gathered
// buffer dies after the forward's last read of it (PyTorch's FSDP frees and refills the memory
// under one storage instead, which a trace cannot record). The tracer holds `from` until tracing
// ends, so that no new proxy storage takes its address.
void trace_redirect_storage(const Storage& from, const Tensor& to);

}  // namespace kiln::compiler
