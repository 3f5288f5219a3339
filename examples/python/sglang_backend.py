"""A trainer updating an SGLang engine through refit (refit.integrations.sglang).

Needs SGLang with a GPU and refit installed (`pip install ./python`):

    python examples/python/sglang_backend.py --model Qwen/Qwen3-0.6B [--tp 1] [--rounds 3]

The engine loads refit's custom weight loader at launch (`custom_weight_loader=[LOADER]`); the
trainer (a Hugging Face model on cuda:0 in this process) sends refit's control messages through
the engine's own `update_weights_from_tensor(..., load_format=LOADER)`: "init" once, then per
round "receive" (the ranks receive into staging and return; the scheduler keeps batching) and
"commit" (installed between two batches). Without a GPU the same adapter is driven on CPU through
SGLang 0.5.23's own updater and Qwen3 model by python/tests/frameworks/test_sglang_real.py.
"""

import argparse

import sglang
import torch
import transformers

from refit.integrations.engine_link import LinkOptions
from refit.integrations.sglang import LOADER, SglangTrainer, engine_call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    engine = sglang.Engine(model_path=args.model, tp_size=args.tp, mem_fraction_static=0.5, custom_weight_loader=[LOADER])
    trainer_model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()

    # begin/end_weight_update around every call: SGLang 0.5.23 refuses updates outside a session.
    trainer = SglangTrainer(engine_call(engine), trainer_model, num_workers=args.tp, options=LinkOptions(verify=True))
    prompt, greedy = "The capital of France is", {"temperature": 0, "max_new_tokens": 8}
    print("before:", engine.generate(prompt, greedy)["text"])
    for round_ in range(args.rounds):
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.add_(torch.randn_like(p) * 1e-3 * (round_ + 1))
        trainer.update()
        engine.flush_cache()
        print(f"round {round_}: engine says:", engine.generate(prompt, greedy)["text"])
    trainer.shutdown()
    engine.shutdown()


if __name__ == "__main__":
    main()
