"""Framework integrations: Megatron-LM parameters as offers, vLLM parameters as needs, and a vLLM
worker extension that receives a refit. Each module's docstring lists its layout rules and the
framework source each follows; none imports torch, Megatron or vLLM at import time.

    from refit.integrations import ModelShape, MegatronPublisher, MegatronRanks, VllmReceiver, VllmRanks
    model = ModelShape.from_hf_config(hf_config)
    offers = MegatronPublisher(model, MegatronRanks(tp=2, tp_rank=r)).table(megatron_model.named_parameters(), 0)
    needs = VllmReceiver(model, VllmRanks(tp=2, tp_rank=r)).table(vllm_model.named_parameters(), 1)
"""

from .layout import ModelShape, ParamLayout, Piece, add_params
from .megatron import MegatronPublisher, MegatronRanks, megatron_layouts
from .vllm import RefitWorkerExtension, VllmRanks, VllmReceiver, vllm_layouts

__all__ = [
    "MegatronPublisher",
    "MegatronRanks",
    "ModelShape",
    "ParamLayout",
    "Piece",
    "RefitWorkerExtension",
    "VllmRanks",
    "VllmReceiver",
    "add_params",
    "megatron_layouts",
    "vllm_layouts",
]
