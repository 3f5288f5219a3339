"""vLLM's CPU platform as this suite runs it: the wheel PyPI serves for Linux (a CUDA build, without
vLLM's CPU kernels in `vllm._C`) on whatever CPU the machine has. Imported, for its effect, by the
modules that build vLLM layers (vllm_harness, vllm_ranks), in every process they run in.

On a CPU with AMX tiles (Sapphire Rapids and later), vLLM's CPU GEMM dispatch
(`dispatch_cpu_unquantized_gemm`, run by process_weights_after_loading) packs small bf16 weights
for sgl-kernel's AMX GEMM with `torch.ops._C.convert_weight_packed`, an op only the CPU build has:
AttributeError, where a CPU without AMX takes oneDNN's path. The suite never runs a GEMM, and which
one vLLM would pick plays no part in loading, so vLLM is told the CPU has no AMX tiles."""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
