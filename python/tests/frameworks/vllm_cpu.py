"""vLLM's CPU platform as this suite runs it: the wheel PyPI serves for Linux (a CUDA build, without
vLLM's CPU kernels in `vllm._C`) on whatever CPU the machine has. Imported, for its effect, by the
modules that build vLLM layers (vllm_harness, vllm_ranks), in every process they run in.

On a CPU with AMX tiles (Sapphire Rapids and later), vLLM's CPU GEMM dispatch
(`dispatch_cpu_unquantized_gemm`, run by process_weights_after_loading) packs small bf16 weights
for sgl-kernel's AMX GEMM with `torch.ops._C.convert_weight_packed`, an op only the CPU build has:
AttributeError, where a CPU without AMX takes oneDNN's path. The suite never runs a GEMM, and which
one vLLM would pick plays no part in loading, so vLLM is told the CPU has no AMX tiles.

vLLM's CPU platform refuses sparse attention (DeepSeek-V3.2's and GLM-5's indexed MLA) when the
layer is built. The attention backend holds no weight and plays no part in loading, so here the
dense MLA backend stands in for it; the indexer's own weights are built and loaded as on a GPU."""

from typing import Any, Optional

import torch

torch.cpu._is_amx_tile_supported = lambda: False


def _dense_backend_for_sparse_attention() -> None:
    from vllm.platforms.cpu import CpuPlatform

    choose = CpuPlatform.get_attn_backend_cls.__func__

    def dense(cls: Any, selected_backend: Any, attn_selector_config: Any, num_heads: Optional[int] = None) -> str:
        if attn_selector_config.use_sparse:
            attn_selector_config = attn_selector_config._replace(use_sparse=False)
        return choose(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(dense)


_dense_backend_for_sparse_attention()
