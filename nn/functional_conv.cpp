// kiln::nn::functional conv2d, conv_transpose2d/1d, max_pool2d, avg_pool2d and batch_norm.
//
// Convolution and pooling gather each output's input window with two
// index_selects (rows, then columns) from the padded input: [N, C, OH, KH, OW,
// KW]. conv2d is then one batched matmul per group (im2col), pooling a
// reduction over the window dims. Everything is a registry op, so autograd gets
// the gradients (index_select's backward accumulates the overlapping windows)
// without hand-written rules. Memory is KH*KW/(SH*SW) times the input: fine for
// the CPU reference and small images; the CUDA backend brings its own kernels.
#include <limits>

#include "autograd/grad_mode.h"
#include "nn/functional.h"

namespace kiln::nn::functional {
namespace {

struct Window {
  int64_t kernel, stride, padding, dilation;
  int64_t out;  // output size along this dim
};

void check_window_args(const ExpandingArray<2> &kernel, const ExpandingArray<2> &stride,
                       const ExpandingArray<2> &padding, const ExpandingArray<2> &dilation,
                       const char *op) {
  for (size_t i = 0; i < 2; ++i) {
    KILN_CHECK(kernel[i] > 0, "[", op, "] kernel_size must be positive, got ", kernel[i]);
    KILN_CHECK(stride[i] > 0, "[", op, "] stride must be positive, got ", stride[i]);
    KILN_CHECK(padding[i] >= 0, "[", op, "] padding must be non-negative, got ", padding[i]);
    KILN_CHECK(dilation[i] > 0, "[", op, "] dilation must be positive, got ", dilation[i]);
  }
}

// Output size of a pooling window as PyTorch's pooling_output_shape: with
// ceil_mode, a last window must still start inside the input or the left
// padding.
int64_t pool_out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d, bool ceil_mode) {
  const int64_t span = in + 2 * p - d * (k - 1) - 1;
  if (span < 0) return 0;
  int64_t out = (span + (ceil_mode ? s - 1 : 0)) / s + 1;
  if (ceil_mode && (out - 1) * s >= in + p) --out;
  return out;
}

// [N, C, H, W] (or [C, H, W], unsqueezed) checks; returns the 4-D input.
Tensor as_batched(const Tensor &input, const char *op) {
  KILN_CHECK(input.defined(), "[", op, "] input is undefined");
  KILN_CHECK(input.dim() == 3 || input.dim() == 4, "[", op,
             "] expected a 3-D (unbatched) or 4-D (batched) input, got shape ",
             shape_str(input.sizes()));
  KILN_CHECK(input.is_floating_point(), "[", op, "] expected a floating-point input, got ",
             dtype_name(input.dtype()));
  return input.dim() == 3 ? input.unsqueeze(0) : input;
}

// Pads [N, C, H, W] so that every window fits and gathers them: [N, C, OH, KH,
// OW, KW].
Tensor gather_windows(const Tensor &x, const Window &h, const Window &w, double pad_value) {
  const auto extent = [](const Window &win, int64_t in) {
    // Right padding: what the last window reaches beyond the input (negative:
    // crop).
    return (win.out - 1) * win.stride + win.dilation * (win.kernel - 1) + 1 - in - win.padding;
  };
  const Tensor xp = functional::pad(
      x, {w.padding, extent(w, x.size(3)), h.padding, extent(h, x.size(2))}, pad_value);
  const auto index = [&](const Window &win) {
    const TensorOptions o = TensorOptions(kInt64).device(x.device());
    return (arange(win.out, o).mul(win.stride).unsqueeze(1) +
            arange(win.kernel, o).mul(win.dilation).unsqueeze(0))
        .flatten();
  };
  return xp.index_select(2, index(h))
      .index_select(3, index(w))
      .view({x.size(0), x.size(1), h.out, h.kernel, w.out, w.kernel});
}

std::pair<Window, Window> pool_windows(const Tensor &x, const ExpandingArray<2> &kernel,
                                       const ExpandingArray<2> &stride,
                                       const ExpandingArray<2> &padding,
                                       const ExpandingArray<2> &dilation, bool ceil_mode,
                                       const char *op) {
  check_window_args(kernel, stride, padding, dilation, op);
  for (size_t i = 0; i < 2; ++i) {
    KILN_CHECK(padding[i] <= kernel[i] / 2, "[", op,
               "] padding should be at most half of the kernel size, got padding ", padding[i],
               " for kernel size ", kernel[i]);
  }
  Window h{kernel[0], stride[0], padding[0], dilation[0], 0};
  Window w{kernel[1], stride[1], padding[1], dilation[1], 0};
  h.out = pool_out_size(x.size(2), h.kernel, h.stride, h.padding, h.dilation, ceil_mode);
  w.out = pool_out_size(x.size(3), w.kernel, w.stride, w.padding, w.dilation, ceil_mode);
  KILN_CHECK(h.out >= 1 && w.out >= 1, "[", op, "] input of shape ", shape_str(x.sizes()),
             " is too small for kernel ", shape_str(kernel.vec()), ": output size would be ", h.out,
             "x", w.out);
  return {h, w};
}

// Transposed convolution of x [N, C_in, H, W] with w [C_in, C_out / g, KH, KW], as the adjoint
// of conv2d's im2col: each input pixel's contribution to its output window is one GEMM per group
// ([N, G, H*W, Cg] @ [G, Cg, Og*KH*KW]), and the windows are scatter-added into the output plane
// with index_add along columns, then rows (the adjoint of gather_windows' two index_selects).
// No multiplications by inserted zeros, unlike conv2d over a dilated input. `shown` is the
// caller's input (for messages), `op` its name.
Tensor conv_transpose(const Tensor &x, const Tensor &weight, const Tensor &bias,
                      const ExpandingArray<2> &stride, const ExpandingArray<2> &padding,
                      const ExpandingArray<2> &output_padding, int64_t groups,
                      const ExpandingArray<2> &dilation, const Tensor &shown, const char *op) {
  KILN_CHECK(weight.dtype() == x.dtype(), "[", op, "] input (", dtype_name(x.dtype()),
             ") and weight (", dtype_name(weight.dtype()), ") must have the same dtype");
  KILN_CHECK(groups > 0, "[", op, "] groups must be positive, got ", groups);
  const int64_t n = x.size(0), c = x.size(1);
  KILN_CHECK(weight.size(0) == c, "[", op, "] input of shape ", shape_str(shown.sizes()), " has ",
             c, " channels, but weight of shape ", shape_str(weight.sizes()), " expects ",
             weight.size(0), " (weight is [in_channels, out_channels / groups, *kernel])");
  KILN_CHECK(c % groups == 0, "[", op, "] in_channels ", c, " must be divisible by groups ",
             groups);
  const int64_t og = weight.size(1), out_c = og * groups, cg = c / groups;
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out_c), "[", op,
             "] expected a bias of shape [", out_c, "], got ",
             bias.defined() ? shape_str(bias.sizes()) : std::string());
  KILN_CHECK(!bias.defined() || bias.dtype() == x.dtype(), "[", op, "] input (",
             dtype_name(x.dtype()), ") and bias (", dtype_name(bias.dtype()),
             ") must have the same dtype");
  const ExpandingArray<2> kernel({weight.size(2), weight.size(3)});
  check_window_args(kernel, stride, padding, dilation, op);
  int64_t out[2], full[2];
  for (size_t i = 0; i < 2; ++i) {
    const int64_t opad = output_padding[i];
    KILN_CHECK(opad >= 0 && (opad < stride[i] || opad < dilation[i]), "[", op,
               "] output_padding must be non-negative and smaller than either stride or ",
               "dilation, got output_padding ", opad, ", stride ", stride[i], ", dilation ",
               dilation[i]);
    // The plane every window lands in (before cropping `padding` from both sides).
    full[i] = (x.size(2 + i) - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1 + opad;
    out[i] = full[i] - 2 * padding[i];
    KILN_CHECK(out[i] > 0, "[", op, "] input of shape ", shape_str(shown.sizes()),
               " with kernel ", shape_str(kernel.vec()), " and padding ",
               shape_str(padding.vec()), " gives a non-positive output size ", out[i]);
  }
  const int64_t h = x.size(2), w = x.size(3), kh = kernel[0], kw = kernel[1];
  const Tensor cols = x.reshape({n, groups, cg, h * w})
                          .transpose(2, 3)
                          .matmul(weight.reshape({groups, cg, og * kh * kw}))
                          .view({n, groups, h, w, og, kh, kw})
                          .permute({0, 1, 4, 2, 5, 3, 6})
                          .reshape({n, out_c, h * kh, w * kw});
  const TensorOptions io = TensorOptions(kInt64).device(x.device());
  const auto index = [&](int64_t in, int64_t k, size_t i) {
    return (arange(in, io).mul(stride[i]).unsqueeze(1) +
            arange(k, io).mul(dilation[i]).unsqueeze(0))
        .flatten();
  };
  const TensorOptions xo = TensorOptions(x.dtype()).device(x.device());
  const Tensor rows = zeros({n, out_c, h * kh, full[1]}, xo).index_add(3, index(w, kw, 1), cols);
  Tensor y = zeros({n, out_c, full[0], full[1]}, xo)
                 .index_add(2, index(h, kh, 0), rows)
                 .narrow(2, padding[0], out[0])
                 .narrow(3, padding[1], out[1]);
  if (bias.defined()) y = y + bias.view({1, out_c, 1, 1});
  return y;
}

}  // namespace

Tensor conv_transpose2d(const Tensor &input, const Tensor &weight,
                        const ConvTranspose2dFuncOptions &options) {
  const Tensor x = as_batched(input, "conv_transpose2d");
  KILN_CHECK(weight.defined() && weight.dim() == 4, "[conv_transpose2d] expected a 4-D weight ",
             "[in, out / groups, kh, kw], got ",
             weight.defined() ? shape_str(weight.sizes()) : std::string("undefined"));
  const Tensor y = conv_transpose(x, weight, options.bias(), options.stride(), options.padding(),
                                  options.output_padding(), options.groups(), options.dilation(),
                                  input, "conv_transpose2d");
  return input.dim() == 3 ? y.squeeze(0) : y;
}

Tensor conv_transpose1d(const Tensor &input, const Tensor &weight,
                        const ConvTranspose1dFuncOptions &options) {
  const char *op = "conv_transpose1d";
  KILN_CHECK(input.defined(), "[", op, "] input is undefined");
  KILN_CHECK(input.dim() == 2 || input.dim() == 3, "[", op,
             "] expected a 2-D (unbatched) or 3-D (batched) input, got shape ",
             shape_str(input.sizes()));
  KILN_CHECK(input.is_floating_point(), "[", op, "] expected a floating-point input, got ",
             dtype_name(input.dtype()));
  KILN_CHECK(weight.defined() && weight.dim() == 3, "[", op, "] expected a 3-D weight ",
             "[in, out / groups, k], got ",
             weight.defined() ? shape_str(weight.sizes()) : std::string("undefined"));
  const Tensor x = (input.dim() == 2 ? input.unsqueeze(0) : input).unsqueeze(2);
  const auto as2 = [](int64_t ones, const ExpandingArray<1> &a) {
    return ExpandingArray<2>({ones, a[0]});
  };
  const Tensor y = conv_transpose(x, weight.unsqueeze(2), options.bias(), as2(1, options.stride()),
                                  as2(0, options.padding()), as2(0, options.output_padding()),
                                  options.groups(), as2(1, options.dilation()), input, op)
                       .squeeze(2);
  return input.dim() == 2 ? y.squeeze(0) : y;
}

Tensor conv2d(const Tensor &input, const Tensor &weight, const Conv2dFuncOptions &options) {
  const Tensor x = as_batched(input, "conv2d");
  KILN_CHECK(weight.defined() && weight.dim() == 4, "[conv2d] expected a 4-D weight ",
             "[out, in / groups, kh, kw], got ",
             weight.defined() ? shape_str(weight.sizes()) : std::string("undefined"));
  KILN_CHECK(weight.dtype() == x.dtype(), "[conv2d] input (", dtype_name(x.dtype()),
             ") and weight (", dtype_name(weight.dtype()), ") must have the same dtype");
  const int64_t groups = options.groups();
  KILN_CHECK(groups > 0, "[conv2d] groups must be positive, got ", groups);
  const int64_t n = x.size(0), c = x.size(1), out_c = weight.size(0);
  KILN_CHECK(out_c % groups == 0, "[conv2d] out_channels ", out_c, " must be divisible by groups ",
             groups);
  KILN_CHECK(c == weight.size(1) * groups, "[conv2d] input of shape ", shape_str(input.sizes()),
             " has ", c, " channels, but weight of shape ", shape_str(weight.sizes()),
             " with groups=", groups, " expects ", weight.size(1) * groups);
  const Tensor &bias = options.bias();
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out_c),
             "[conv2d] expected a bias of shape [", out_c, "], got ",
             bias.defined() ? shape_str(bias.sizes()) : std::string());
  const ExpandingArray<2> kernel({weight.size(2), weight.size(3)});
  check_window_args(kernel, options.stride(), options.padding(), options.dilation(), "conv2d");
  Window win[2];
  for (size_t i = 0; i < 2; ++i) {
    win[i] = {kernel[i], options.stride()[i], options.padding()[i], options.dilation()[i], 0};
    const int64_t in = x.size(2 + i);
    const int64_t span = in + 2 * win[i].padding - win[i].dilation * (kernel[i] - 1) - 1;
    KILN_CHECK(span >= 0, "[conv2d] kernel size ", shape_str(kernel.vec()), " (dilated by ",
               shape_str(options.dilation().vec()), ") can't be greater than the padded input ",
               "size; input shape ", shape_str(input.sizes()));
    win[i].out = span / win[i].stride + 1;
  }
  const Window &h = win[0];
  const Window &w = win[1];
  const int64_t cg = c / groups, og = out_c / groups, k = cg * h.kernel * w.kernel;
  // im2col: [N, G, OH * OW, Cg * KH * KW] @ [G, Cg * KH * KW, Og] -> [N, G, OH
  // * OW, Og].
  const Tensor cols = gather_windows(x, h, w, 0.0)
                          .view({n, groups, cg, h.out, h.kernel, w.out, w.kernel})
                          .permute({0, 1, 3, 5, 2, 4, 6})
                          .reshape({n, groups, h.out * w.out, k});
  const Tensor wmat = weight.reshape({groups, og, k}).transpose(1, 2);
  Tensor out = cols.matmul(wmat).permute({0, 1, 3, 2}).reshape({n, out_c, h.out, w.out});
  if (bias.defined()) out = out + bias.view({1, out_c, 1, 1});
  return input.dim() == 3 ? out.squeeze(0) : out;
}

std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor &input,
                                                   const MaxPool2dFuncOptions &options) {
  const Tensor x = as_batched(input, "max_pool2d");
  const auto [h, w] = pool_windows(x, options.kernel_size(), options.stride(), options.padding(),
                                   options.dilation(), options.ceil_mode(), "max_pool2d");
  const int64_t n = x.size(0), c = x.size(1);
  const Tensor windows = gather_windows(x, h, w, -std::numeric_limits<double>::infinity())
                             .permute({0, 1, 2, 4, 3, 5})
                             .reshape({n, c, h.out, w.out, h.kernel * w.kernel});
  // max over the window gives the gradient to one maximum (max_dim's backward
  // scatters).
  auto [values, arg] = windows.max(-1);
  // The argmax's position in the input plane: row oh*s - p + kh*d, column
  // likewise.
  const TensorOptions o = TensorOptions(kInt64).device(x.device());
  const Tensor kh = arg.div(Scalar(w.kernel), "floor");
  const Tensor kw = arg - kh * w.kernel;
  const Tensor row =
      arange(h.out, o).mul(h.stride).sub(h.padding).view({h.out, 1}) + kh * h.dilation;
  const Tensor col =
      arange(w.out, o).mul(w.stride).sub(w.padding).view({1, w.out}) + kw * w.dilation;
  Tensor indices = row * x.size(3) + col;
  if (input.dim() == 3) return {values.squeeze(0), indices.squeeze(0)};
  return {values, indices};
}

Tensor max_pool2d(const Tensor &input, const MaxPool2dFuncOptions &options) {
  return std::get<0>(max_pool2d_with_indices(input, options));
}

Tensor avg_pool2d(const Tensor &input, const AvgPool2dFuncOptions &options) {
  const Tensor x = as_batched(input, "avg_pool2d");
  const auto [h, w] = pool_windows(x, options.kernel_size(), options.stride(), options.padding(),
                                   /*dilation=*/1, options.ceil_mode(), "avg_pool2d");
  const std::optional<int64_t> divisor = options.divisor_override();
  KILN_CHECK(!divisor || *divisor != 0, "[avg_pool2d] divisor_override must be non-zero");
  const Tensor sums = gather_windows(x, h, w, 0.0).sum({3, 5});
  Tensor out;
  if (divisor) {
    out = sums / static_cast<double>(*divisor);
  } else {
    // Each window's divisor, as PyTorch: the positions inside the padded input
    // (count_include_pad) or inside the input; separable into rows times
    // columns.
    const auto counts = [&](const Window &win, int64_t in) {
      std::vector<double> cnt(win.out);
      for (int64_t o = 0; o < win.out; ++o) {
        const int64_t start = o * win.stride - win.padding;
        const int64_t end = start + win.kernel;
        const int64_t lo = options.count_include_pad() ? -win.padding : 0;
        const int64_t hi = options.count_include_pad() ? in + win.padding : in;
        cnt[o] = static_cast<double>(std::max<int64_t>(std::min(end, hi) - std::max(start, lo), 0));
      }
      return from_blob(cnt.data(), {win.out}, kFloat64).clone();
    };
    const Tensor divisors =
        counts(h, x.size(2)).view({h.out, 1}) * counts(w, x.size(3)).view({1, w.out});
    out = sums / divisors.to(x.device(), x.dtype());
  }
  return input.dim() == 3 ? out.squeeze(0) : out;
}

Tensor batch_norm(const Tensor &input, const Tensor &running_mean, const Tensor &running_var,
                  const BatchNormFuncOptions &options) {
  KILN_CHECK(input.defined() && input.dim() >= 2,
             "[batch_norm] expected an input [N, C, *] of at least 2 dims, got ",
             input.defined() ? shape_str(input.sizes()) : std::string("undefined"));
  KILN_CHECK(input.is_floating_point(), "[batch_norm] expected a floating-point input, got ",
             dtype_name(input.dtype()));
  const int64_t c = input.size(1);
  const auto check_c = [&](const Tensor &t, const char *what) {
    KILN_CHECK(!t.defined() || (t.dim() == 1 && t.size(0) == c), "[batch_norm] expected ", what,
               " of shape [", c, "], got ", t.defined() ? shape_str(t.sizes()) : std::string());
  };
  check_c(running_mean, "running_mean");
  check_c(running_var, "running_var");
  check_c(options.weight(), "weight");
  check_c(options.bias(), "bias");
  KILN_CHECK(running_mean.defined() == running_var.defined(),
             "[batch_norm] running_mean and running_var must both be given or "
             "both be absent");
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  Shape bshape(input.dim(), 1);
  bshape[1] = c;
  const bool reduced = input.dtype() == kFloat16 || input.dtype() == kBFloat16;
  const Tensor x = reduced ? input.to(kFloat32) : input;

  Tensor mean, var;
  if (options.training()) {
    const int64_t count = input.numel() / std::max<int64_t>(c, 1);
    KILN_CHECK(count > 1, "[batch_norm] expected more than 1 value per channel when training, ",
               "got input of shape ", shape_str(input.sizes()));
    mean = x.mean(dims);
    var = x.var(dims, /*correction=*/0);
    if (running_mean.defined()) {
      // running = (1 - m) running + m stat, with the unbiased variance, outside
      // the graph.
      NoGradGuard no_grad;
      const double m = options.momentum();
      const double unbias = static_cast<double>(count) / static_cast<double>(count - 1);
      Tensor rm = running_mean, rv = running_var;
      rm.mul_(1.0 - m).add_(mean.detach().to(rm.dtype()), m);
      rv.mul_(1.0 - m).add_(var.detach().to(rv.dtype()), m * unbias);
    }
  } else {
    KILN_CHECK(running_mean.defined(),
               "[batch_norm] running_mean and running_var are needed when not "
               "training");
    mean = running_mean.to(x.dtype());
    var = running_var.to(x.dtype());
  }
  Tensor y = (x - mean.view(bshape)) * (var.view(bshape) + options.eps()).rsqrt();
  if (options.weight().defined()) y = y * options.weight().to(x.dtype()).view(bshape);
  if (options.bias().defined()) y = y + options.bias().to(x.dtype()).view(bshape);
  return y.to(input.dtype());
}

}  // namespace kiln::nn::functional
