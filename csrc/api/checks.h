// Labelled argument checks for the torch-facing layer: "<arg> must be <expected>, got <actual>".
// The Python layer (kda_ops/_validate.py) validates every public call first and raises
// TypeError/ValueError; these checks guard direct torch.ops.kda calls against memory errors.
#pragma once
#include <torch/library.h>
#include <ATen/ATen.h>

#define KDA_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)
#define KDA_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, __VA_ARGS__)

#define KDA_CHECK_LASTDIM_CONTIGUOUS(t, name) \
  KDA_CHECK((t).stride(-1) == 1, name, " must have a contiguous last dim, got strides ", (t).strides())

#define KDA_CHECK_DTYPE(t, dt, name) \
  KDA_CHECK_TYPE((t).scalar_type() == (dt), name, " must be ", (dt), ", got ", (t).scalar_type())

#define KDA_CHECK_SAME_DEVICE(t, ref, name) \
  KDA_CHECK((t).device() == (ref).device(), name, " must be on ", (ref).device(), ", got ", (t).device())
