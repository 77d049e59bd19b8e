"""The real ``spaces`` package in ZeroGPU mode on a machine with no GPU: this CPU as the device.

``start()`` serves the device API's stand-in (``device_api``), points ``spaces`` at it
(``SPACES_ZERO_GPU=true``, ``SPACES_ZERO_DEVICE_API_URL``; its packing folder in a temporary
one, and its clean-up after packing kept away from the Hugging Face cache), imports ``spaces``
(its CUDA emulation starts then) and patches exactly two functions of it, both of them run only
in a call's worker, after the fork:

- ``spaces.zero.torch.init`` (``patching.init``): it sets ``CUDA_VISIBLE_DEVICES`` to the slot's
  GPU and then initialises CUDA (``torch.Tensor([0]).cuda()``), which fails here with "Found no
  NVIDIA driver". Patched: it sets the variable only.
- ``spaces.zero.torch.move`` (``patching.move``): it copies every tensor placed on ``cuda`` in
  the main process (kept in memory, or packed to disk at launch) onto the worker's GPU and points
  the emulated tensors at those copies. Patched: the same copies, into the worker's host memory,
  read from the same places (the same pack files, in the same order).

Everything else is the package's own: the schedule with the visitor's token, the fork of the
worker, pickling in and out, the Gradio request context, streaming a generator's yields, worker
reuse, failure on a dead worker, the CUDA emulation in the main process, packing at launch. What
this cannot show: real CUDA initialisation in a worker, host-to-GPU copies, the GPU's kernels and
memory; ``tools/gpu_check.py`` runs a turn's call body on a real GPU for that.
"""

from __future__ import annotations

import os
import tempfile

from tests.zerogpu.device_api import DeviceAPI

_API: DeviceAPI | None = None


def start() -> DeviceAPI:
    """The stand-in, serving, with ``spaces`` imported against it (once per process)."""
    global _API
    if _API is not None:
        return _API
    api = DeviceAPI().start()
    home = tempfile.mkdtemp(prefix="zerogpu-")
    os.environ.update(SPACES_ZERO_GPU="true", SPACES_ZERO_DEVICE_API_URL=api.url,
                      ZEROGPU_OFFLOAD_DIR=os.path.join(home, "tensors"),
                      ZEROGPU_MMAP_AUTOPRUNE_PATTERN=os.path.join(home, "no-such-folder", "*"))
    import spaces  # noqa: F401  (starts the CUDA emulation)
    import spaces.zero.torch as zero_torch

    zero_torch.init = _init_without_cuda
    zero_torch.move = _move_to_host
    _API = api
    return api


def _init_without_cuda(nvidia_uuid: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = nvidia_uuid


def _move_to_host(callback=None) -> None:
    import torch
    from spaces.zero.torch import patching

    for fake, original in patching.cuda_aliases.items():
        if original is not None:  # never packed: still in memory
            fake.data = torch.Tensor(original)
    for pack in patching.tensor_packs:
        with open(pack.path(), "rb") as f:
            data = f.read()
        offset = 0
        for batch in pack.batches:
            for tensor, size, aligned_size in batch:
                _point(pack, tensor, data[offset:offset + size])
                offset += aligned_size
        for tensor, size, aligned_size in pack.big_tensors:
            _point(pack, tensor, data[offset:offset + size])
            offset += aligned_size


def _point(pack, tensor, raw: bytes) -> None:
    import torch

    storage = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    host = torch.tensor([], dtype=tensor.dtype).set_(storage.untyped_storage(), 0, tensor.shape, tensor.stride())
    for fake in pack.fakes[tensor]:
        fake.data = host
