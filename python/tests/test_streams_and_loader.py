"""Stream arguments in every form refit takes (ints, the __cuda_stream__ protocol, torch- and
CuPy-shaped objects, HostStream, None as torch's current stream), the loader's error, and the
annotations of the public API."""

from __future__ import annotations

import ctypes
import importlib
import inspect
import os
import subprocess
import sys
import types
import unittest
from pathlib import Path

import refit
from refit._lib import stream_value

ROOT = Path(__file__).resolve().parents[2]


class ProtocolMethod:
    def __init__(self, handle, version=0):
        self.value = (version, handle)

    def __cuda_stream__(self):
        return self.value


class ProtocolAttribute:
    __cuda_stream__ = (0, 0x5000)


class TorchLike:
    cuda_stream = 0x1000


class CupyLike:
    ptr = 0x2000


class FakeTorch:
    """Stands in for torch in sys.modules: records which device's current stream was asked for."""

    def __init__(self, initialized):
        self.asked = []
        self.cuda = types.SimpleNamespace(is_initialized=lambda: initialized, current_stream=self.current_stream)

    def current_stream(self, device):
        self.asked.append(device)
        return types.SimpleNamespace(cuda_stream=0x7000 + (device or 0))


class StreamValueTest(unittest.TestCase):
    def test_every_stream_form(self):
        self.assertEqual(stream_value(0x1234), 0x1234)
        self.assertEqual(stream_value(ProtocolMethod(0x4000)), 0x4000)
        self.assertEqual(stream_value(ProtocolAttribute()), 0x5000)
        self.assertEqual(stream_value(TorchLike()), 0x1000)
        self.assertEqual(stream_value(CupyLike()), 0x2000)
        with refit.HostStream() as host:
            self.assertEqual(stream_value(host), host.handle)

    def test_bad_streams_are_invalid_arguments(self):
        for bad in (True, -1, 1 << 64, "stream", 1.5, ProtocolMethod(0x4000, version=1), ProtocolMethod("x")):
            with self.assertRaises(refit.RefitError) as caught:
                stream_value(bad)
            self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT, repr(bad))
        with self.assertRaises(refit.RefitError) as caught:
            stream_value(ProtocolMethod(7, version=2))
        self.assertIn("not (0, handle)", caught.exception.message)

    def test_none_is_torch_current_stream_once_torch_uses_cuda(self):
        saved = sys.modules.get("torch")
        try:
            sys.modules.pop("torch", None)
            self.assertEqual(stream_value(None, 1), 0)  # no torch: the legacy default stream
            fake = sys.modules["torch"] = FakeTorch(initialized=False)
            self.assertEqual(stream_value(None, 1), 0)  # torch without CUDA in use
            fake = sys.modules["torch"] = FakeTorch(initialized=True)
            self.assertEqual(stream_value(None, 1), 0x7001)
            self.assertEqual(stream_value(None), 0x7000)
            self.assertEqual(fake.asked, [1, None])
            self.assertEqual(stream_value(None, 1, host=True), 0)  # a host-backend group keeps 0
            # A host-backend group's calls keep the default stream, even with torch using CUDA.
            src, dst = (ctypes.c_uint8 * 8)(*range(8)), (ctypes.c_uint8 * 8)()
            with refit.Group([0, 1], refit.Backend.HOST) as group:
                with group.scope():
                    group.copy_batch(1, [(ctypes.addressof(src), ctypes.addressof(dst), 8)])
            self.assertEqual(list(dst), list(range(8)))
            self.assertEqual(fake.asked, [1, None])
        finally:
            if saved is None:
                sys.modules.pop("torch", None)
            else:
                sys.modules["torch"] = saved


class LoaderTest(unittest.TestCase):
    def import_refit(self, library):
        env = dict(os.environ, REFIT_LIBRARY=library, PYTHONPATH=str(ROOT / "python"))
        return subprocess.run([sys.executable, "-c", "import refit"], env=env, capture_output=True, text=True)

    def test_missing_library_names_where_it_looked_and_the_fix(self):
        result = self.import_refit("/nonexistent/librefit.so")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("librefit.so not found in REFIT_LIBRARY; looked at /nonexistent/librefit.so", result.stderr)
        self.assertIn("pip install ./python", result.stderr)

    def test_unloadable_library_says_which_file_and_why(self):
        result = self.import_refit(__file__)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f"{__file__} exists but cannot be loaded", result.stderr)


MODULES = [
    "refit",
    "refit._handle",
    "refit._lib",
    "refit.copy",
    "refit.executor",
    "refit.group",
    "refit.plan",
    "refit.segment",
    "refit.tensor",
    "refit.integrations.layout",
    "refit.integrations.megatron",
    "refit.integrations.vllm",
]


class AnnotationTest(unittest.TestCase):
    def test_every_public_function_and_method_is_annotated(self):
        unannotated = []
        for name in MODULES:
            module = importlib.import_module(name)
            for obj_name, obj in vars(module).items():
                if getattr(obj, "__module__", None) != name:
                    continue
                functions = [(obj_name, obj)] if inspect.isfunction(obj) else []
                if inspect.isclass(obj):
                    for attr, member in vars(obj).items():
                        member = getattr(member, "fget", None) or getattr(member, "__func__", member)
                        own = inspect.isfunction(member) and member.__module__ == name
                        if own and (not attr.startswith("_") or attr == "__init__"):
                            functions.append((f"{obj_name}.{attr}", member))
                for qualified, function in functions:
                    signature = inspect.signature(function)
                    missing = [
                        p.name
                        for p in signature.parameters.values()
                        if p.annotation is inspect.Parameter.empty and p.name not in ("self", "cls")
                    ]
                    if missing or signature.return_annotation is inspect.Signature.empty:
                        unannotated.append(f"{name}.{qualified} {missing}")
        self.assertEqual(unannotated, [])
        self.assertTrue((ROOT / "python/refit/py.typed").exists())


if __name__ == "__main__":
    unittest.main()
