"""Framework integrations: publishers from the trainer's own description (Megatron-core's sharded
state dict, DTensor placements, a whole HF module) as offers; receivers recorded from an engine's own
weight loader (recorder.py, receiver.py; vLLM's in vllm.py with a worker extension that receives a
refit). None imports torch, Megatron or vLLM at import time.

    from refit.integrations import VllmReceiver, record, RecordedReceiver
    needs = VllmReceiver.from_engine(vllm_config).table(vllm_model.named_parameters(), 1)   # in a worker
    recording = record(module_loader, meta_module.named_parameters(), checkpoint_specs)     # any loader
    needs = RecordedReceiver(recording).table(module.named_parameters(), 1)
"""

from .dtensor import DTensorPublisher
from .hf import HfPublisher
from .layout import ModelShape, ParamLayout, Piece, add_params
from .megatron import MegatronModulePublisher, MegatronPublisher, MegatronRanks, megatron_layouts
from .offers import Offer, add_offers
from .receiver import RecordedReceiver
from .recorder import Recording, TensorSpec, record
from .vllm import RefitWorkerExtension, VllmRanks, VllmReceiver, vllm_layouts

__all__ = [
    "DTensorPublisher",
    "HfPublisher",
    "MegatronModulePublisher",
    "MegatronPublisher",
    "Offer",
    "MegatronRanks",
    "ModelShape",
    "ParamLayout",
    "Piece",
    "RecordedReceiver",
    "Recording",
    "RefitWorkerExtension",
    "TensorSpec",
    "VllmRanks",
    "VllmReceiver",
    "add_offers",
    "add_params",
    "megatron_layouts",
    "record",
    "vllm_layouts",
]
