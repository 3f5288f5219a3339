"""refit.integrations with torch modules: tiny Qwen3-MoE and Llama models whose parameters are laid
out as Megatron (publishers) and vLLM (receivers) hold them, refit on the GPU (one or two devices;
on the host backend where torch has no CUDA), compared bit for bit with the vLLM layout built
independently from the same checkpoint (hostmodels.py). Skipped where torch is missing, as in CI.
On the GPU machine, after gpu/stage.sh, from the repository root:
    REFIT_LIBRARY=.gpu/lib/librefit.so PYTHONPATH=python:python/tests NCCL_NVLS_ENABLE=0 \\
        python3 -m unittest -v test_integrations_torch
"""

from __future__ import annotations

import importlib.util
import unittest
from typing import Dict, List

import refit
from hostmodels import POISON, checkpoint, megatron_params, vllm_params
from refit.integrations import MegatronPublisher, MegatronRanks, ModelShape, VllmRanks, VllmReceiver

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch

QWEN3_MOE = ModelShape(
    layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, vocab=200, experts=8, moe_ffn=16, qk_norm=True, name="qwen3-moe"
)
LLAMA = ModelShape(layers=4, hidden=32, heads=8, kv_heads=2, head_dim=4, vocab=150, ffn=48, name="llama")


def module_with(params: Dict[str, "torch.Tensor"]) -> "torch.nn.Module":
    """An nn.Module whose named_parameters() are exactly `params` (dotted names become submodules)."""
    root = torch.nn.Module()
    for name, tensor in params.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def bf16(values: List[int], shape, device) -> "torch.Tensor":
    """uint16 bit patterns as a bf16 tensor (compared as int16 bits, so NaN patterns compare too)."""
    bits = torch.tensor(values, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(shape).to(device)


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class TorchModuleRefitTest(unittest.TestCase):
    def setUp(self):
        self.cuda = torch.cuda.is_available()
        count = min(torch.cuda.device_count(), 2) if self.cuda else 2
        self.devices = list(range(count))
        backend = refit.Backend.CUDA if self.cuda else refit.Backend.HOST
        self.group = refit.Group(self.devices, backend=backend)

    def tearDown(self):
        self.group.close()

    def torch_device(self, rank: int):
        return torch.device("cuda", self.devices[rank % len(self.devices)]) if self.cuda else torch.device("cpu")

    def refit(self, model, trainer: List[MegatronRanks], engine: List[VllmRanks], engine_layers: List[range]):
        ckpt = checkpoint(model)
        # Tables hold raw addresses: every module must outlive the copies (a freed tensor's memory
        # is handed to the next allocation, so a dropped publisher would alias a receiver).
        tables, received, publishers = [], [], []
        for i, ranks in enumerate(trainer):
            publisher = MegatronPublisher(model, ranks)
            values = megatron_params(model, ranks, ckpt)
            device = self.torch_device(i)
            megatron = module_with({l.name: bf16(values[l.name], l.shape, device) for l in publisher.layouts})
            host_device = None if self.cuda else i % len(self.devices)
            tables.append(publisher.table(megatron.named_parameters(), 0, device=host_device))
            publishers.append(megatron)
        for i, (ranks, layers) in enumerate(zip(engine, engine_layers)):
            receiver = VllmReceiver(model, ranks)
            device = self.torch_device(i)
            vllm = module_with({l.name: bf16([POISON] * l.numel, l.shape, device) for l in receiver.layouts})
            host_device = None if self.cuda else i % len(self.devices)
            tables.append(receiver.table(vllm.named_parameters(), 0, device=host_device))
            received.append((ranks, layers, vllm))
        with refit.Plan.build(tables) as plan:
            for table in tables:
                table.close()
            for route in plan.routes():
                rank = self.devices.index(route.dst_device)
                # torch's current stream of that device by default; synchronized below.
                self.group.copy_batch(rank, route.segments)
        if self.cuda:
            for device in self.devices:
                torch.cuda.synchronize(device)
        for ranks, layers, vllm in received:
            expected = vllm_params(model, ranks, ckpt, layers)
            params = dict(vllm.named_parameters())
            self.assertEqual(set(params), set(expected))
            for name, tensor in params.items():
                want = bf16(expected[name], tensor.shape, tensor.device)
                got_bits, want_bits = tensor.view(torch.int16).flatten(), want.view(torch.int16).flatten()
                wrong = (got_bits != want_bits).nonzero().flatten().tolist()
                self.assertEqual(
                    wrong,
                    [],
                    f"{ranks} {name}: {len(wrong)} of {tensor.numel()} elements differ; first at "
                    f"{wrong[:1]}: got {got_bits[wrong[:1]].tolist()}, want {want_bits[wrong[:1]].tolist()}",
                )

    def test_qwen3_moe_megatron_tp2_ep2_to_vllm_tp2(self):
        trainer = [MegatronRanks(tp=2, tp_rank=r % 2, ep=2, ep_rank=r % 2, etp=1, etp_rank=0, dp=2, dp_rank=r // 2) for r in range(4)]
        engine = [VllmRanks(tp=2, tp_rank=r) for r in range(2)]
        self.refit(QWEN3_MOE, trainer, engine, [range(2)] * 2)

    def test_qwen3_moe_megatron_ep4_stacked_experts_to_vllm_expert_parallel(self):
        trainer = [MegatronRanks(ep=4, ep_rank=r, dp=4, dp_rank=r, grouped_experts=True) for r in range(4)]
        engine = [VllmRanks(tp=2, tp_rank=r, ep=2, ep_rank=r) for r in range(2)]
        self.refit(QWEN3_MOE, trainer, engine, [range(2)] * 2)

    def test_llama_megatron_tp2_pp2_to_vllm_tp4_replicating_kv_heads(self):
        trainer = [MegatronRanks(tp=2, tp_rank=r % 2, pp=2, pp_rank=r // 2) for r in range(4)]
        engine = [VllmRanks(tp=4, tp_rank=r) for r in range(4)]
        self.refit(LLAMA, trainer, engine, [range(4)] * 4)


if __name__ == "__main__":
    unittest.main()
