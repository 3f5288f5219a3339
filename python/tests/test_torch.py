"""refit.torch on CUDA: allgather and batched copies of torch tensors through a CUDA group, ordered
with torch's streams, compared byte-exact with torch's own result. Skipped (reported as such, never
as passing) where torch or a GPU is missing, as in CI. On the GPU machine, after gpu/stage.sh, from
the repository root (this runs the host-backend tests too):
    REFIT_LIBRARY=.gpu/lib/librefit.so PYTHONPATH=python NCCL_NVLS_ENABLE=0 \
        python3 -m unittest discover -v -s python/tests
"""

import importlib.util
import unittest

import refit

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch

    import refit.torch as rt

HAVE_GPU = HAVE_TORCH and torch.cuda.is_available()


@unittest.skipUnless(HAVE_GPU, "needs torch with a CUDA device")
class TorchTest(unittest.TestCase):
    def setUp(self):
        self.devices = list(range(min(torch.cuda.device_count(), 2)))
        self.group = refit.Group(self.devices, backend=refit.Backend.CUDA)

    def tearDown(self):
        self.group.close()

    def test_allgather_in_a_scope_ordered_with_torch_streams(self):
        counts = [1000 + 333 * rank for rank in range(len(self.devices))]
        total = sum(counts)
        sends = [
            torch.randint(0, 256, (count,), dtype=torch.uint8, device=f"cuda:{device}")
            for device, count in zip(self.devices, counts)
        ]
        recvs = [torch.full((total,), 0xAB, dtype=torch.uint8, device=f"cuda:{d}") for d in self.devices]
        expected = torch.cat([send.cpu() for send in sends])
        with self.group.scope(rt.current_streams(self.group), mode=refit.ExitMode.ASYNC):
            picked = self.group.allgather(
                [rt.data_ptr(s) for s in sends],
                [rt.data_ptr(r) for r in recvs],
                [rt.nbytes(s) for s in sends],
            )
        self.assertIn(picked, (refit.Algorithm.PEER, refit.Algorithm.NCCL))
        for recv in recvs:
            self.assertTrue(torch.equal(recv.cpu(), expected))  # .cpu() waits on the current stream

    def test_copy_batch_on_the_rank_stream_from_run(self):
        device = self.devices[-1]
        source = torch.arange(64 * 48, dtype=torch.int32, device=f"cuda:{device}").reshape(64, 48)
        target = torch.full((64, 24), -1, dtype=torch.int32, device=f"cuda:{device}")
        rank = len(self.devices) - 1
        # Columns 24..47 of every row: 96 bytes, 64 times, 192 bytes apart in the source.
        half = refit.Segment(rt.data_ptr(source) + 96, rt.data_ptr(target), 96, (64, 1), (192, 0), (96, 0))

        def body(r, stream):
            if r == rank:
                self.group.copy_batch(r, [half], stream, checked=True)
                rt.rank_stream(self.group, r).synchronize()

        self.group.run(body)
        self.assertTrue(torch.equal(target.cpu(), source[:, 24:].cpu()))

    def test_nbytes_refuses_a_non_contiguous_tensor(self):
        with self.assertRaises(refit.RefitError) as caught:
            rt.nbytes(torch.zeros(4, 4, device="cuda:0").t())
        self.assertIs(caught.exception.status, refit.Status.INVALID_ARGUMENT)


if __name__ == "__main__":
    unittest.main()
