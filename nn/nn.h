// kiln::nn: everything for building and training models, in one include (kiln.h includes it).
//
//   namespace nn = kiln::nn;
//   namespace F = kiln::nn::functional;
//
// Modules and holders (nn/module.h), layers (nn/modules/), stateless functions and losses
// (nn/functional.h), initialisers (nn/init.h), checkpoints (nn/serialize.h,
// nn/safetensors.h).
#pragma once

#include "nn/functional.h"
#include "nn/init.h"
#include "nn/module.h"
#include "nn/modules/activation.h"
#include "nn/modules/container.h"
#include "nn/modules/conv.h"
#include "nn/modules/conv_transpose.h"
#include "nn/modules/dropout.h"
#include "nn/modules/embedding.h"
#include "nn/modules/linear.h"
#include "nn/modules/loss.h"
#include "nn/modules/normalization.h"
#include "nn/modules/pooling.h"
#include "nn/modules/rnn.h"
#include "nn/safetensors.h"
#include "nn/serialize.h"
