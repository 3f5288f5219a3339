"""Needs recorded from a module's own loader (refit.integrations.recorder), installed on the GPU:
a small torch module whose loader transposes one weight, fuses two into one parameter and scales a
third (which is staged and loaded by the loader itself), recorded on the meta device; refit moves
whole checkpoint tensors from one device into the module on another (the host backend where torch
has no CUDA); every element equals what the loader itself gives. Skipped without torch, as in CI's
default suite (the real-framework suite, .ci/frameworks, runs the recorder against vLLM on CPU).
On the GPU machine, after gpu/stage.sh, from the repository root:
    REFIT_LIBRARY=.gpu/lib/librefit.so PYTHONPATH=python:python/tests NCCL_NVLS_ENABLE=0 \\
        python3 -m unittest -v test_integrations_recorded
"""

from __future__ import annotations

import importlib.util
import unittest

import refit
from refit.integrations import RecordedReceiver, record

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch

POISON = -7.0


def make(device, dtype):
    return {
        "proj_t": torch.empty(48, 32, device=device, dtype=dtype),  # stored transposed
        "fused": torch.empty(2 * 24, 32, device=device, dtype=dtype),  # gate rows, then up rows
        "scaled": torch.empty(32, device=device, dtype=dtype),
    }


def loader_of(params):
    def load(items):
        for name, tensor in items:
            if name == "proj.weight":
                params["proj_t"].copy_(tensor.t())
            elif name in ("gate.weight", "up.weight"):
                half = 0 if name == "gate.weight" else 1
                params["fused"].narrow(0, 24 * half, 24).copy_(tensor)
            elif name == "norm.weight":
                params["scaled"].copy_(tensor * 2)

    return load


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class RecordedModuleRefitTest(unittest.TestCase):
    def test_recorded_needs_installed_on_another_device(self):
        cuda = torch.cuda.is_available()
        two = cuda and torch.cuda.device_count() >= 2
        dtype = torch.bfloat16
        specs = {
            "proj.weight": ((32, 48), dtype),
            "gate.weight": ((24, 32), dtype),
            "up.weight": ((24, 32), dtype),
            "norm.weight": ((32,), dtype),
        }
        src_device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        dst_device = torch.device("cuda", 1 if two else 0) if cuda else torch.device("cpu")
        ckpt, start = {}, 1
        for name, (shape, _) in specs.items():
            n = 1
            for e in shape:
                n *= e
            # bf16 holds integers up to 256 exactly: encode positions modulo 251, offset per tensor.
            ckpt[name] = ((torch.arange(n) + start) % 251).to(dtype).reshape(shape).to(src_device)
            start += 37
        truth = make(dst_device, dtype)
        loader_of(truth)(ckpt.items())
        meta = make("meta", dtype)
        recording = record(loader_of(meta), meta, specs, cache=False)
        self.assertEqual(recording.staged, {"norm.weight": "computed by mul"})
        params = {name: torch.full_like(t, POISON) for name, t in truth.items()}
        receiver = RecordedReceiver(recording)
        staging = receiver.staging_buffers(lambda shape, dt: torch.empty(shape, dtype=dt, device=dst_device))
        devices = sorted({src_device.index or 0, dst_device.index or 0}) if cuda else [0, 1]
        src, dst = (devices[0], devices[-1]) if cuda else (0, 1)
        with refit.Table() as offers:
            for name, tensor in ckpt.items():
                index = offers.add_tensor(name, tuple(tensor.shape), 2, 2)
                offers.add_offer(index, 0, src, tensor.data_ptr(), (0,) * tensor.dim(), tuple(tensor.shape))
            host = None if cuda else dst
            with receiver.table(params, 0, device=host, staging=staging) as needs:
                backend = refit.Backend.CUDA if cuda else refit.Backend.HOST
                with refit.Plan.build([offers, needs]) as plan, refit.Group(devices, backend=backend) as group:
                    for route in plan.routes():
                        group.copy_batch(devices.index(route.dst_device), route.segments)
        if cuda:
            for d in devices:
                torch.cuda.synchronize(d)
        receiver.load_staged(loader_of(params), staging)
        for name in truth:
            self.assertTrue(torch.equal(truth[name], params[name]), name)


if __name__ == "__main__":
    unittest.main()
