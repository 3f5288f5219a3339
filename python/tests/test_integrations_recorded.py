"""Needs recorded from a module's own loader (refit.integrations.recorder), installed on the GPU:
a small torch module whose loader transposes one weight, fuses two into one parameter and scales a
third (which is staged and loaded by the loader itself), recorded on the meta device; refit moves
whole checkpoint tensors from one device into the module on another (the host backend where torch
has no CUDA); every element equals what the loader itself gives. And a layer the engine
post-processes (the reload path), whose loader reads a TP share of one tensor: only that share
crosses into the tensor's staging buffer, while tensors also read elsewhere, computed from, or
read in boxes that meet cross whole; the loader given the buffers makes what it makes of the
checkpoint (host backend). Skipped without torch, as in CI's
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
from refit.tensor import dtype_code

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

    def test_a_reloaded_tensor_read_in_part_crosses_in_part(self):
        # A layer the engine post-processes ("layer.*": its tensors go to the reload path) reads
        # the first half of "share" (a TP share); "both" also lands in a parameter of another path;
        # "scaled" is computed from; "overlapping" is read twice, in boxes that meet.
        dtype = torch.float32
        specs = {name: ((8, 4), dtype) for name in ("share", "both", "scaled", "overlapping")}
        meta = {"layer.share": torch.empty(4, 4, device="meta"), "layer.both": torch.empty(8, 4, device="meta"),
                "other.both": torch.empty(8, 4, device="meta"), "layer.scaled": torch.empty(8, 4, device="meta"),
                "layer.overlapping": torch.empty(2, 6, 4, device="meta")}

        def load(params, items):
            for name, tensor in items:
                if name == "share":
                    params["layer.share"].copy_(tensor.narrow(0, 0, 4))
                elif name == "both":
                    params["layer.both"].copy_(tensor)
                    params["other.both"].copy_(tensor)
                elif name == "scaled":
                    params["layer.scaled"].copy_(tensor * 2)
                elif name == "overlapping":
                    params["layer.overlapping"][0].copy_(tensor.narrow(0, 0, 6))
                    params["layer.overlapping"][1].copy_(tensor.narrow(0, 2, 6))

        recording = record(lambda items: load(meta, items), meta, specs, cache=False)
        reloaded = {name: "post-processed" for name in meta if name.startswith("layer.")}
        receiver = RecordedReceiver(recording, reloaded)
        self.assertEqual(sorted(receiver.reload), ["both", "overlapping", "scaled", "share"])
        self.assertEqual(receiver.reload_boxes, {"share": [((0, 0), (4, 4))]})
        # Through the host backend: "share"'s buffer gets its first four rows only, the rest whole.
        ckpt = {name: torch.arange(32, dtype=dtype).reshape(8, 4) + 100 * i for i, name in enumerate(specs)}
        staging = receiver.staging_buffers(lambda shape, dt: torch.full(shape, POISON, dtype=dt))
        live = {name: torch.full_like(t, POISON, device="cpu") for name, t in meta.items()}
        with refit.Table() as offers:
            for name, tensor in ckpt.items():
                offers.add_offer(offers.add_tensor(name, (8, 4), 4, dtype_code("float32")), 0, 0, tensor.data_ptr(), (0, 0), (8, 4))
            with receiver.table(live, 1, device=1, staging=staging) as needs:
                with refit.Plan.build([offers, needs]) as plan, refit.Group([0, 1], backend=refit.Backend.HOST) as group:
                    for route in plan.routes():
                        group.copy_batch(1, route.segments)
        self.assertTrue(torch.equal(staging["share"][:4], ckpt["share"][:4]))
        self.assertTrue(bool((staging["share"][4:] == POISON).all()), "rows the loader does not read crossed")
        for name in ("both", "scaled", "overlapping"):
            self.assertTrue(torch.equal(staging[name], ckpt[name]), name)
        # The reload path's loader, given the buffers, makes what it makes of the checkpoint.
        truth = {name: torch.empty_like(t, device="cpu") for name, t in meta.items()}
        load(truth, ckpt.items())
        load(live, receiver.reloaded_tensors(staging))
        for name in truth:
            self.assertTrue(torch.equal(truth[name], live[name]), name)


if __name__ == "__main__":
    unittest.main()
