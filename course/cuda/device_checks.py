"""The device checks CUDA PyTorch makes before a kernel runs, in its words.

TensorIterator's kernels (`add`, `mul`, `where`, ... marked `device_check: NoCheck` in native_functions.yaml) let a
0-dim CPU tensor join a GPU op as a scalar. Every other op with a CUDA kernel gets a wrapper that compares the devices
of its out= and positional tensor arguments, one by one, and refuses any difference, a 0-dim CPU tensor included
(`c10::impl::check_and_update_common_device`, aten/src/ATen/core/op_registration/adaption.h; the wrapper is written by
`gen_device_check` in torchgen/dest/register_dispatch_key.py): `x.clamp(max=shape[1] - 1)` with a CPU `shape` runs on a
CPU but stops on a GPU (native_functions.py reads the yaml). Some kernels compare devices themselves first: masked_fill
(aten/src/ATen/native/cuda/Indexing.cu) and convolution, which compares its tensors' types before it picks cuDNN or
oneDNN (aten/src/ATen/native/Convolution.cpp).
"""
from __future__ import annotations

import torch

from course.cuda import native_functions
from course.cuda.devices import CPU, EmulatedTensor, device_name


def _wrapper_kind(name: str) -> bool | None:
    """For an op ("clamp.Tensor") whose CUDA wrapper checks devices (not `device_check: NoCheck`, with a CUDA kernel
    of its own or through its structured delegate): whether that wrapper is a structured kernel's. Else None."""
    entry = native_functions.fields(name)
    if not entry or entry.get("device_check") == "NoCheck":
        return None
    if native_functions.has_cuda_kernel(name):
        return entry.get("structured") == "True"
    delegate = entry.get("structured_delegate")
    return True if delegate and native_functions.has_cuda_kernel(delegate) else None


# Ops whose kernel on a GPU is a composite one (CompositeExplicitAutograd) that calls a checked op on the same tensors:
# `embedding` is `weight.index_select(0, indices)`, `stack` a `cat` of its tensors unsqueezed.
_COMPOSITES = {
    torch.ops.aten.embedding.default: (torch.ops.aten.index_select.default,
                                       lambda weight, indices, *_args, **_kwargs: (weight, 0, indices)),
    torch.ops.aten.stack.default: (torch.ops.aten.cat.default, lambda tensors, dim=0: (tensors, dim)),
}
_checks: dict = {}  # by the C++ operator, whose hash is C's (an OpOverload's is a Python call)


def checks_devices(func) -> bool:
    """Whether `func`'s CUDA kernel sits behind a generated wrapper that compares its arguments' devices."""
    answer = _checks.get(func._op)
    if answer is None:
        answer = _checks[func._op] = func in _COMPOSITES or _wrapper_kind(native_functions.op_name(func)) is not None
    return answer


def _wrapper_name(func) -> str:
    """torchgen's name for the wrapper: a structured kernel's is named after the op, an unstructured one's after its
    overload first (`wrapper_CUDA_clamp_Tensor`, `wrapper_CUDA__index_select`)."""
    base = func._schema.name[6:] + ("_out" if any(a.is_out for a in func._schema.arguments) else "")
    overload = "" if func._overloadname == "default" else func._overloadname
    if _wrapper_kind(native_functions.op_name(func)):
        return f"wrapper_CUDA_{base}_{overload}" if overload else f"wrapper_CUDA_{base}"
    return f"wrapper_CUDA_{overload}_{base}"


def _device(tensor: torch.Tensor) -> int:
    return tensor._device_index if isinstance(tensor, EmulatedTensor) else CPU


def check(func, args, kwargs) -> None:
    """Raise the wrapper's error if `func`'s arguments are not all on one device: out= arguments first, then the
    positional ones in the schema's order (keyword-only ones are not checked), each tensor of a list in turn."""
    if not checks_devices(func):
        return
    if func in _COMPOSITES:
        func, arguments = _COMPOSITES[func]
        args, kwargs = arguments(*args, **kwargs), {}
    schema = func._schema.arguments
    named = {}
    for position, argument in enumerate(schema):
        if position < len(args) and not argument.kwarg_only:
            named[argument.name] = args[position]
        else:
            named[argument.name] = kwargs.get(argument.name)
    checked = [a.name for a in schema if a.is_out] + [a.name for a in schema if not a.kwarg_only]
    common = None
    for name in checked:
        value = named[name]
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if not isinstance(tensor, torch.Tensor):
                continue
            if common is None:
                common = _device(tensor)
            elif _device(tensor) != common:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but got {name} is on "
                    f"{device_name(_device(tensor))}, different from other tensors on {device_name(common)} (when "
                    f"checking argument in method {_wrapper_name(func)})")


def check_masked_fill(args, host_tensor_from_program) -> None:
    """masked_fill_'s own check, of any two devices. A host mask C++ made for itself (the math attention's causal mask)
    stands for one on the GPU: `host_tensor_from_program()` says whether the program's call handed it a host tensor."""
    self, mask = _device(args[0]), _device(args[1])
    if self != mask and (CPU not in (self, mask) or host_tensor_from_program()):
        raise RuntimeError(f"expected self and mask to be on the same device, but got mask on {device_name(mask)} "
                           f"and self on {device_name(self)}")


# `Tensor::toString()` after torch/csrc/Exceptions.cpp's `processErrorMsg`, which gives the legacy types their names
_LEGACY_NAMES = {torch.uint8: "Byte", torch.int8: "Char", torch.float64: "Double", torch.float32: "Float",
                 torch.int32: "Int", torch.int64: "Long", torch.int16: "Short", torch.float16: "Half"}


def _type_name(tensor: torch.Tensor, on_gpu: bool) -> str:
    legacy = _LEGACY_NAMES.get(tensor.dtype)
    if legacy is not None:
        return f"torch.cuda.{legacy}Tensor" if on_gpu else f"torch.{legacy}Tensor"
    scalar_type = {torch.bfloat16: "BFloat16", torch.bool: "Bool", torch.complex64: "ComplexFloat",
                   torch.complex128: "ComplexDouble"}.get(tensor.dtype, str(tensor.dtype))
    return f"{'CUDA' if on_gpu else 'CPU'}{scalar_type}Type"


def _goes_to_cudnn(args) -> bool:
    """`_select_conv_backend` for a GPU input: cuDNN for floating types, but a float or double depthwise 2-D
    convolution goes to `_conv_depthwise2d`'s own kernel, without cuDNN's type check."""
    image, weight, transposed, groups = args[0], args[1], args[6], args[8]
    depthwise = not transposed and image.dim() == 4 and groups > 1 and image.size(1) == groups and \
        weight.size(0) % groups == 0
    return image.is_floating_point() and not (depthwise and image.dtype in (torch.float32, torch.float64))


def _check_cudnn_types(image, parameters, on_gpu) -> None:
    """`check_input_same_type_as_parameters`: `TensorOptions::type_equal`, the same dtype on the same kind of device
    (a GPU's index is not compared). `on_gpu(tensor)` says where a tensor is."""
    for name, parameter in parameters:
        if parameter is not None and (parameter.dtype != image.dtype or on_gpu(parameter) != on_gpu(image)):
            raise RuntimeError(f"Input type ({_type_name(image, on_gpu(image))}) and {name} type "
                               f"({_type_name(parameter, on_gpu(parameter))}) should be the same")


def check_convolution_types(args) -> None:
    """cuDNN's type check of a convolution whose tensors are all on GPUs (`args` unwrapped): the CPU's kernels word
    it otherwise ("Input type (c10::Half) and bias type (float)")."""
    if _goes_to_cudnn(args):
        _check_cudnn_types(args[0], (("weight", args[1]), ("bias", args[2])), lambda tensor: True)


def check_convolution(args, host_tensor_from_program) -> None:
    """`aten.convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)` on tensors
    of two devices. A GPU input goes to cuDNN, which first compares types ("Input type (torch.cuda.FloatTensor) and
    weight type (torch.FloatTensor) should be the same"), then meets `cudnn_convolution`'s wrapper (weights on another
    GPU); a float host input big enough for oneDNN gets oneDNN's type check. Others keep the generic error."""
    image, weight, bias, transposed = args[0], args[1], args[2], args[6]
    on_host = [t for t in (image, weight, bias) if t is not None and _device(t) == CPU]
    if on_host and not host_tensor_from_program():
        return  # a host tensor PyTorch's C++ made for itself (a forward-mode tangent's zeros) stands for GPU memory
    if _device(image) != CPU:
        if _goes_to_cudnn(args):
            _check_cudnn_types(image, (("weight", weight), ("bias", bias)), lambda tensor: _device(tensor) != CPU)
            cudnn = torch.ops.aten.cudnn_convolution_transpose if transposed else torch.ops.aten.cudnn_convolution
            check(cudnn.default, (image, weight), {})
    elif image.dtype == torch.float32 and _device(weight) != CPU and (
            image.numel() >= 16 or image.size(0) >= 16 or any(s != 1 for s in args[3]) or any(d != 1 for d in args[5])):
        raise RuntimeError(f"Input type ({_type_name(image, False)}) and weight type ({_type_name(weight, True)}) "
                           "should be the same or input should be a MKLDNN tensor and weight is a dense tensor")
