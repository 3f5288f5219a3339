"""A trainer updating a vLLM engine through refit, vLLM's weight-transfer backend "refit".

Needs vLLM (0.33) with a GPU and refit installed (`pip install ./python`: its `vllm.general_plugins`
entry point registers the backend in every vLLM process, so the engine needs no refit code):

    python examples/python/vllm_backend.py --model Qwen/Qwen3-0.6B [--tp 1] [--rounds 3]

The trainer here is a Hugging Face model on cuda:0 in this process (vLLM's ModuleSource over it:
whole tensors offered); the engine is `LLM(..., weight_transfer_config={"backend": "refit"})`, its
workers in their own processes, reached through a client of vLLM's four control-plane calls over
`LLM.collective_rpc`. Each round the trainer changes its weights, the workers receive them into
staging while the engine could keep generating, and commit at finish_weight_update; the engine's
output follows. Without a GPU the same engine classes are driven directly on CPU by
python/tests/frameworks/test_vllm_backend.py (host backend, two TP ranks, every element checked).
"""

import argparse

import torch
import transformers
from vllm import LLM, SamplingParams
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from refit.integrations.vllm_backend import RefitTrainerInitInfo, register


class LLMClient:
    """vLLM's VLLMWeightSyncClient for the offline LLM: each call runs on every worker."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info):
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self):
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info):
        self.llm.collective_rpc("update_weights", args=(update_info,))

    def finish_weight_update(self, weight_version=None):
        self.llm.collective_rpc("finish_weight_update")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    register()  # this process's trainer factory (the entry point does it in vLLM's processes)
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, dtype="bfloat16", enforce_eager=True,
              gpu_memory_utilization=0.5, weight_transfer_config={"backend": "refit"})
    trainer_model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()
    info = RefitTrainerInitInfo(rank=0, num_workers=args.tp, verify=True)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=ModuleSource(trainer_model))
    prompt, greedy = "The capital of France is", SamplingParams(temperature=0, max_tokens=8)
    print("before:", llm.generate([prompt], greedy)[0].outputs[0].text)
    for round_ in range(args.rounds):
        with torch.no_grad():  # a stand-in for an optimizer step: noise that changes the output
            for p in trainer_model.parameters():
                p.add_(torch.randn_like(p) * 1e-3 * (round_ + 1))
        engine.send_weights()
        stats = engine.last_stats
        print(f"round {round_}: refit moved {sum(stats.bytes) / 1e9:.2f} GB; engine says:",
              llm.generate([prompt], greedy)[0].outputs[0].text)
    engine.shutdown()


if __name__ == "__main__":
    main()
