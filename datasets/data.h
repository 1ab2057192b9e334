// kiln::data: datasets, transforms, samplers and data loaders in torch::data's spelling (one
// include; kiln.h includes it).
//
//   namespace data = kiln::data;
//   auto ds = data::datasets::MNIST(root)
//                 .map(data::transforms::Normalize<>(0.1307, 0.3081))
//                 .map(data::transforms::Stack<>());
//   auto loader = data::make_data_loader(std::move(ds),
//                                        data::DataLoaderOptions().batch_size(64).workers(2));
//   for (auto& batch : *loader) train_step(batch.data, batch.target);
//
// Examples (example.h), datasets and MapDataset (dataset.h), transforms (transforms.h),
// samplers (samplers.h), make_data_loader (dataloader.h), MNIST (mnist.h). docs/datasets.md is
// the guide. The folder is datasets/ because data/ holds the bundled corpus.
#pragma once

#include "datasets/dataloader.h"
#include "datasets/dataset.h"
#include "datasets/example.h"
#include "datasets/mnist.h"
#include "datasets/samplers.h"
#include "datasets/transforms.h"
