"""Host memory a cache hands to the GPU, behind two small seams (tests/cuda/conftest.py's fake_cuda replaces them).

`pinned(t)`: a page-locked copy of a small host tensor, such as a block table's new rows, so that its copy to the
device can be asynchronous: `copy_(..., non_blocking=True)` from pageable memory makes the host wait for the copy.

`page_locked_zeros(shape, dtype)`: a large zero-filled host store whose pages are locked exactly. torch's
`pin_memory=True` goes through its caching host allocator, which rounds every block up to the next power of two
(aten/src/ATen/core/CachingHostAllocator.h: "Round up the allocation to the nearest power of two to improve reuse"),
so an offloaded KV store of 9 GiB would lock 16 GiB of host memory (vLLM issue 56410 and sglang PR 36562 met the same
rounding). Here the store is ordinary memory, registered with cudaHostRegister, which locks exactly its bytes, and
unregistered when the tensor is collected.
"""

from __future__ import annotations

import weakref

import torch


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of a small host tensor (rounding is irrelevant at this size)."""
    return tensor.pin_memory()


def cudart():
    """The CUDA runtime's Python bindings (cudaHostRegister, cudaHostUnregister): a seam the tests replace."""
    return torch.cuda.cudart()


CUDA_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: page-locked, portable to the current context only


def page_locked_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor whose numel * element_size bytes are page-locked, not one byte more."""
    tensor = torch.zeros(shape, dtype=dtype)  # zero-filled: every page is touched before it is locked
    runtime = cudart()
    n_bytes = tensor.numel() * tensor.element_size()
    error = int(runtime.cudaHostRegister(tensor.data_ptr(), n_bytes, CUDA_HOST_REGISTER_DEFAULT))
    if error:  # cudaSuccess is 0
        raise RuntimeError(f"cudaHostRegister of a {n_bytes}-byte host KV store failed with CUDA error {error}")
    # Unregister when the tensor goes, before its memory is returned; holding only the address keeps it collectable.
    weakref.finalize(tensor, runtime.cudaHostUnregister, tensor.data_ptr())
    return tensor
