"""A Megatron -> vLLM refit shim on refit.integrations: the whole shim is `refit_weights` below.

In a colocated RL loop (trainer and inference engine in one process, one GPU per rank of each),
call it after each optimizer step with both models' parameters. For a vLLM engine in worker
processes of its own, the same tables meet through refit.integrations.vllm.RefitWorkerExtension
(refit_needs / refit_receive via llm.collective_rpc).

Run as a script, it refits a tiny Qwen3-MoE from a Megatron EP2 layout into a vLLM TP2 layout held in
host memory (the host backend standing in for two GPUs) and checks the fused expert weights.
"""

import ctypes

import refit
from refit.integrations import MegatronPublisher, MegatronRanks, ModelShape, VllmRanks, VllmReceiver


def refit_weights(model, trainer, engine, group):
    """Moves every weight from the trainer's parameters into the engine's. `trainer` / `engine`: one
    (MegatronRanks or VllmRanks, named parameters) per rank of `group`, in rank order."""
    tables = [
        MegatronPublisher(model, ranks).table(params, process=0, device=group.device(rank))
        for rank, (ranks, params) in enumerate(trainer)
    ] + [
        VllmReceiver(model, ranks).table(params, process=0, device=group.device(rank))
        for rank, (ranks, params) in enumerate(engine)
    ]
    with refit.Plan.build(tables) as plan:
        for table in tables:
            table.close()
        # In a loop, keep the executor and call run() at every step: descriptors are built once.
        with plan.executor(group, process=0, verify=True) as executor:
            executor.run()
        return plan.stats


class HostTensor:
    """Zeroed host memory that looks like a contiguous torch bf16 tensor to refit."""

    dtype = "bfloat16"
    device = type("Device", (), {"type": "cpu", "index": None})()

    def __init__(self, shape):
        self.shape = shape
        self.strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            self.strides[d] = self.strides[d + 1] * shape[d + 1]
        self.buffer = (ctypes.c_uint16 * (self.strides[0] * shape[0]))()

    def data_ptr(self):
        return ctypes.addressof(self.buffer)

    def element_size(self):
        return 2

    def stride(self):
        return tuple(self.strides)


if __name__ == "__main__":
    model = ModelShape(layers=2, hidden=16, heads=4, kv_heads=2, head_dim=4, vocab=128, experts=4, moe_ffn=8)
    trainer, engine = [], []
    for rank in range(2):
        ranks = MegatronRanks(ep=2, ep_rank=rank)
        params = {p.name: HostTensor(p.shape) for p in MegatronPublisher(model, ranks).layouts}
        for tensor in params.values():
            tensor.buffer[:] = [1 + i % 1000 for i in range(len(tensor.buffer))]  # stand-in weights
        trainer.append((ranks, params))
        ranks = VllmRanks(tp=2, tp_rank=rank)
        engine.append((ranks, {p.name: HostTensor(p.shape) for p in VllmReceiver(model, ranks).layouts}))
    with refit.Group([0, 1], backend=refit.Backend.HOST) as group:
        stats = refit_weights(model, trainer, engine, group)
    for _, params in engine:
        w13 = params["model.layers.1.mlp.experts.routed_experts.w13_weight"]
        assert all(w13.buffer), "every element of each fused w13_weight was written"
    print(f"shim: {stats.needed_bytes} bytes of {len(model.checkpoint_tensors())} tensors refit in {stats.routes} routes")
