// kiln: the umbrella header. `#include <kiln/kiln.h>` gives the whole user-facing API, as
// <torch/torch.h> does for libtorch.
#pragma once

#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "autograd/gradcheck.h"
#include "kernels/cuda/runtime.h"
#include "nn/nn.h"
#include "nn/safetensors.h"
#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/indexing.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/random.h"
#include "tensor/scalar.h"
#include "tensor/tensor.h"
#include "tensor/tensor_data.h"
#include "tensor/tensor_options.h"
