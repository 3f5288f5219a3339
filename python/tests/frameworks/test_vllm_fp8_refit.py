"""A vLLM 0.33 engine that quantizes BF16 weights online (`quantization="fp8_per_block"`) refit
through refit.integrations, with the quantization done by refit during the refit.

The engine holds vLLM's FP8 codes and scales from the initial checkpoint; the trainer offers a
changed BF16 checkpoint; the receiver (VllmReceiver.from_engine, inside RefitWorkerExtension, and
the weight-transfer backend's own engine_receiver / receiver_table) turns every checkpoint box that
lands in an FP8 layer into a quantized need (Arithmetic.DEEPGEMM, as vLLM's own call of
per_block_cast_to_fp8 asks), and the host backend runs the plan. Then every FP8 code and every
scale of every quantized layer, and every element of the other parameters (embeddings, norms,
lm_head), equals what vLLM's own fresh load + process_weights_after_loading of the new checkpoint
serves; the parameters keep their storage; nothing is staged in BF16 and vLLM's reload path does
not run. At tensor-parallel sizes 1 and 2 (gloo stand-in groups, vllm_harness).

The same for an engine serving per-channel FP8 (`quantization="fp8_per_channel"`, vLLM's own CPU
GEMM kernel): every box becomes a per-row quantized need (Arithmetic.VLLM_CHANNEL) writing the
transposed codes vLLM serves; in the row-parallel layers at TP 2, whose row amax vLLM takes across
the ranks, each rank's scales share amax keys (one per row), which a plan over every rank's table
ties (this harness plans one rank at a time, as its stand-in groups reduce nothing;
test_vllm_backend compares with a real TP group's load), and all of it equals vLLM's fresh load.

The block GEMM kernel is fp8_engines' stand-in; everything else is vLLM's.
"""

from __future__ import annotations

import logging
import unittest

import torch

import fp8_engines as fp8
import refit
import vllm_harness as harness
from refit import Arithmetic, Fp8, Granularity, Quantization
from refit.integrations.layout import ParamLayout, Piece
from refit.integrations.receiver import QuantizedParam, RecordedReceiver, unfit_boxes
from refit.integrations.recorder import ParamInfo, Recording, TensorSpec

# Per decoder layer: q, k, v, o, gate, up and down each land in an FP8 layer as one box.
BOXES_PER_LAYER = 7


class QuantizedRefitTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.kernel = fp8.use_kernel(fp8.cutlass_kernel())
        # The checkpoint on disk is BF16, as the trainer offers it: the receiver reads its names,
        # shapes and dtypes from the folder's safetensors headers (checkpoint_of).
        cls.folder = harness.hf_folder("qwen3-fp8-refit", fp8.qwen3_config(), torch.bfloat16)
        cls.initial, cls.update = fp8.bf16_checkpoints(cls.folder, 2)

    @classmethod
    def tearDownClass(cls) -> None:
        fp8.use_kernel(cls.kernel)

    def check_worker(self, parallel: harness.Parallel, rank: int) -> None:
        config = harness.engine_config(self.folder, parallel, "bfloat16", "fp8_per_block")
        with harness.as_rank(config, parallel, rank, 0):
            engine = fp8.served(config, self.initial)
            layers = fp8.fp8_layers(engine)
            self.assertEqual(len(layers), 8)
            before = fp8.addresses(engine)
            worker = fp8.Worker(config, engine)
            with self.assertLogs("refit.integrations.vllm", logging.INFO) as logs:
                worker.refit_needs(0, device=0, backend=refit.Backend.HOST)
            self.assertTrue(any("16 in 8 layers are quantized by refit during the refit (FP8 codes and scales, DEEPGEMM)" in line
                                for line in logs.output), logs.output)
            receiver = worker._refit()["receiver"]
            quantized = sorted(n for n, path in receiver.paths.items() if path == "quantized")
            self.assertEqual(quantized, sorted(f"{layer}.{p}" for layer in layers for p in ("weight", "weight_scale_inv")))
            self.assertTrue(all(path == "boxes" for n, path in receiver.paths.items() if n not in quantized), receiver.paths)
            self.assertEqual((receiver.reload, receiver.staged, worker._refit()["staging"]), ({}, {}, {}))
            self.assertEqual({spec.quantization for spec in receiver.quantized.values()},
                             {Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128), Arithmetic.DEEPGEMM)})

            for ckpt in (self.update, self.initial):  # a trainer's step, then another through the same executor
                worker.refit_receive([fp8.publisher_table(ckpt)])
                compared = fp8.compare(fp8.served(config, ckpt), engine)
                self.assertEqual(compared.mismatches, [])
                # Every code and scale of both decoder layers' qkv, o, gate_up and down (this rank's).
                per_rank = 2 * (1024 * 256 + 256 * 512 + 1024 * 256 + 256 * 512) // parallel.tp
                self.assertEqual(compared.codes, per_rank)
                self.assertEqual(compared.scales, per_rank // (128 * 128))
                self.assertGreater(compared.other, 0)
            self.assertEqual(fp8.addresses(engine), before, "the live FP8 storage moved")
            # Quantized where the BF16 is offered (in place): only codes and scales reach the
            # engine, nothing is staged in BF16.
            plan = worker._refit()["plan"]
            stats = plan.stats
            self.assertEqual(stats.quantized_needs, 2 * BOXES_PER_LAYER)
            self.assertEqual(stats.quantized_elements, per_rank)
            self.assertEqual((stats.quantized_direct_bytes, stats.quantized_staged_bytes), (2 * per_rank, 0))
            self.assertEqual({route.path for route in plan.quant_routes()}, {refit.QuantPath.IN_PLACE})
            worker.refit_close()
            # Recorded again, from the recorder's cache: the meta copy is not loaded, and vLLM's
            # method quantizes it in post_processed instead. The same layers are quantized.
            worker.refit_needs(0, device=0, backend=refit.Backend.HOST)
            self.assertEqual(worker._refit()["receiver"].quantized, receiver.quantized)
            worker.refit_receive([fp8.publisher_table(self.update)])
            self.assertEqual(fp8.compare(fp8.served(config, self.update), engine).mismatches, [])
            # The FP8 weights move (as vLLM's sleep / wake reallocates them): the executor cannot
            # follow quantized needs' codes and scales, so the worker plans again, into the new storage.
            moved = [p for n, p in engine.named_parameters() if receiver.paths[n] == "quantized"]
            with torch.no_grad():
                for param in moved:
                    param.data = param.data.clone()
            self.assertEqual(worker.refit_rebind(), len(moved))
            worker.refit_receive([fp8.publisher_table(self.initial)])
            self.assertEqual(fp8.compare(fp8.served(config, self.initial), engine).mismatches, [])
            worker.refit_close()

    def test_tp1_worker_quantizes_and_equals_vllms_fresh_load(self) -> None:
        self.check_worker(harness.Parallel(1), 0)

    def test_tp2_every_rank_quantizes_and_equals_vllms_fresh_load(self) -> None:
        for rank in range(2):
            with self.subTest(rank=rank):
                self.check_worker(harness.Parallel(2), rank)

    def backend_refit(self, quantize: bool) -> refit.RunStats:
        """The backend's own receiver and table (vllm_backend.engine_receiver / receiver_table),
        planned with the trainer's offers in one process, run on the host backend with the
        backend's all-or-nothing commit: nothing live changes at the run, all of it after the
        commit (and, without quantizing, vLLM's reload of the staged BF16)."""
        from refit.integrations.vllm_backend import engine_receiver, receiver_table

        parallel = harness.Parallel(2)
        config = harness.engine_config(self.folder, parallel, "bfloat16", "fp8_per_block")
        with harness.as_rank(config, parallel, 1, 0):
            engine = fp8.served(config, self.initial)
            receiver, staging = engine_receiver(engine, config, quantize)
            quantized = sum(1 for path in receiver.paths.values() if path == "quantized")
            self.assertEqual(quantized, 16 if quantize else 0)
            self.assertEqual(staging == {}, quantize)
            with refit.Table.decode(fp8.publisher_table(self.update)) as offers, receiver_table(receiver, engine, staging, 0, 1) as needs:
                with refit.Plan.build([offers, needs]) as plan, refit.Group([0, 1], refit.Backend.HOST) as group:
                    with plan.executor(group, 0, commit=refit.Commit.STAGED) as executor:
                        ran = executor.run()
                        self.assertEqual(fp8.compare(fp8.served(config, self.initial), engine).mismatches, [])
                        executor.commit()
            installed = receiver.install_staged(engine, staging, config.model_config)
            self.assertEqual(installed["reload"] > 0, not quantize, installed)
            self.assertEqual(fp8.compare(fp8.served(config, self.update), engine).mismatches, [])
        return ran

    def test_weight_transfer_backends_receiver_quantizes_too(self) -> None:
        ran = self.backend_refit(quantize=True)
        self.assertEqual(ran.quantized_elements, (1024 * 256 + 256 * 512) * 2)  # TP 2: half of each layer

    def test_weight_transfer_backend_can_leave_quantizing_to_vllm(self) -> None:
        """What a worker does under RefitInitInfo.quantize_online_fp8=False (the trainer's init
        info passes its own on): the FP8 layers' BF16 arrives in staging and vLLM's reload
        quantizes it."""
        self.assertEqual(self.backend_refit(quantize=False).quantized_elements, 0)


class PerChannelRefitTest(unittest.TestCase):
    """`quantization="fp8_per_channel"` (vLLM's Fp8PtpcOnlineLinearMethod, with its own CPU GEMM
    kernel): one float32 scale per output channel (Arithmetic.VLLM_CHANNEL) and codes served as the
    transpose of [N, K] row-major codes. Every box holds whole rows, so refit quantizes it, except
    where vLLM takes a row's amax across the tensor-parallel ranks (o_proj and down_proj, row
    parallel, at TP 2): those layers keep the reload path. Everything equals vLLM's fresh load."""

    Q = Quantization(Fp8.E4M3FN, Granularity.ROW, arithmetic=Arithmetic.VLLM_CHANNEL)

    @classmethod
    def setUpClass(cls) -> None:
        cls.folder = harness.hf_folder("qwen3-fp8-channel", fp8.qwen3_config(), torch.bfloat16)
        cls.initial, cls.update = fp8.bf16_checkpoints(cls.folder, 2)

    def check_worker(self, parallel: harness.Parallel, rank: int) -> None:
        config = harness.engine_config(self.folder, parallel, "bfloat16", "fp8_per_channel")
        with harness.as_rank(config, parallel, rank, 0):
            engine = fp8.served(config, self.initial)
            layers = fp8.fp8_layers(engine)
            self.assertEqual(len(layers), 8)
            row_parallel = [layer for layer in layers if layer.endswith(("o_proj", "down_proj"))]
            before = fp8.addresses(engine)
            worker = fp8.Worker(config, engine)
            worker.refit_needs(0, device=0, backend=refit.Backend.HOST)
            receiver = worker._refit()["receiver"]
            quantized = sorted(n for n, path in receiver.paths.items() if path == "quantized")
            self.assertEqual(quantized, sorted(f"{layer}.{p}" for layer in layers for p in ("weight", "weight_scale")))
            self.assertEqual({(spec.quantization, spec.transposed) for spec in receiver.quantized.values()}, {(self.Q, True)})
            self.assertEqual(receiver.reload_layers, [])
            # At TP 2 the row-parallel layers' rows take their amax across the ranks: their scales
            # share amax keys (one per layer and row), which a plan over every rank's table ties
            # (test_vllm_backend checks the values against a real TP group's load).
            shared = sorted(name.rsplit(".", 1)[0] for name, spec in receiver.quantized.items() if spec.shared_amax)
            self.assertEqual(shared, sorted(row_parallel) if parallel.tp > 1 else [])
            keys = refit.Table.decode(worker._refit_encode_needs()).encode()
            self.assertEqual(keys[4], 4 if parallel.tp > 1 else 3, "the table's format: with amax keys at TP 2 only")

            # This rank's rows of qkv [1024, 256] and gate_up [1024, 256]; o_proj and down_proj
            # [256, 512] split by columns.
            codes = 2 * (2 * 1024 * 256 + 2 * 256 * 512) // parallel.tp
            scales = 2 * (2 * 1024 // parallel.tp + 2 * 256)
            for ckpt in (self.update, self.initial):
                worker.refit_receive([fp8.publisher_table(ckpt)])
                compared = fp8.compare(fp8.served(config, ckpt), engine)
                self.assertEqual(compared.mismatches, [])
                self.assertEqual((compared.codes, compared.scales), (codes, scales))
            self.assertEqual(fp8.addresses(engine), before, "the live FP8 storage moved")
            stats = worker._refit()["plan"].stats
            # Every FP8 layer: this rank's rows of qkv and gate_up, its columns of o_proj and down_proj.
            self.assertEqual(stats.quantized_elements, codes)
            self.assertEqual(stats.quantized_staged_bytes, 0)
            worker.refit_close()

    def test_tp1_every_layer_is_quantized_by_refit(self) -> None:
        self.check_worker(harness.Parallel(1), 0)

    def test_tp2_row_parallel_layers_share_each_rows_amax_across_ranks(self) -> None:
        for rank in range(2):
            with self.subTest(rank=rank):
                self.check_worker(harness.Parallel(2), rank)


class QuantizedBoxesTest(unittest.TestCase):
    """Which recorded boxes can each be one quantized need (receiver.unfit_boxes), and what the
    receiver refuses, on hand-made recordings (no engine)."""

    Q = Quantization(Fp8.E4M3FN, Granularity.BLOCK, (128, 128), Arithmetic.DEEPGEMM)

    def recording(self, pieces, shape=(384, 256)) -> Recording:
        specs = {p.tensor: TensorSpec(p.tensor, (1024, 1024), torch.bfloat16) for p in pieces}
        layout = ParamLayout("layer.weight", shape, tuple(pieces))
        return Recording([layout], {}, {"layer.weight": ParamInfo(shape, (shape[1], 1), torch.bfloat16)}, specs, [], {}, {})

    def why(self, pieces, shape=(384, 256)):
        rec = self.recording(pieces, shape)
        return unfit_boxes(rec.layouts[0], (128, 128), rec.checkpoint)

    def test_boxes_on_block_boundaries_fit_and_others_do_not(self) -> None:
        rows = lambda t, n, at, cols=256, col=0: Piece(t, (0, 0), (n, cols), at * 256 + col, (256, 1))  # noqa: E731
        self.assertIsNone(self.why([rows("q", 256, 0), rows("k", 128, 256)]))
        self.assertIsNone(self.why([rows("q", 256, 0), rows("k", 100, 256)], (356, 256)))  # a last partial block
        self.assertIsNone(self.why([rows("a", 384, 0, 128), rows("b", 384, 0, 128, 128)]))  # column halves
        self.assertIn("inside a block another box shares", self.why([rows("q", 200, 0), rows("k", 184, 200)]))
        self.assertIn("starts at row 64", self.why([rows("k", 320, 64), rows("q", 64, 0)]))
        self.assertIn("starts at row 0, column 64", self.why([rows("b", 384, 0, 192, 64), rows("a", 384, 0, 64)]))
        self.assertIn("cover 256", self.why([Piece("q", (0, 0), (1, 256), 0, (512, 1))], (1, 512)))
        self.assertIn("not as rows", self.why([Piece("q", (0, 0), (256, 384), 0, (1, 256))]))

    def test_the_receiver_refuses_unfit_boxes_and_other_live_layouts(self) -> None:
        pieces = [Piece("q", (0, 0), (200, 256), 0, (256, 1)), Piece("k", (0, 0), (184, 256), 200 * 256, (256, 1))]
        spec = {"layer.weight": QuantizedParam("layer.weight_scale_inv", self.Q)}
        with self.assertRaises(refit.RefitError) as caught:
            RecordedReceiver(self.recording(pieces), quantized=spec)
        self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT)
        self.assertIn("cannot be quantized box by box", str(caught.exception))
        receiver = RecordedReceiver(self.recording([Piece("q", (0, 0), (384, 256), 0, (256, 1))]), quantized=spec)
        self.assertEqual(receiver.paths, {"layer.weight": "quantized", "layer.weight_scale_inv": "quantized"})
        good = {"layer.weight": torch.empty(384, 256, dtype=torch.float8_e4m3fn), "layer.weight_scale_inv": torch.empty(3, 2)}
        with refit.Table() as table:
            self.assertEqual(receiver.add_to(table, good, 0, 0), 1)
        for name, tensor in (("layer.weight", torch.empty(384, 256, dtype=torch.bfloat16)),
                             ("layer.weight_scale_inv", torch.empty(2, 3).t())):
            with self.subTest(name=name), refit.Table() as table, self.assertRaises(refit.RefitError) as caught:
                receiver.add_to(table, {**good, name: tensor}, 0, 0)
            self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT)
            self.assertIn(name, str(caught.exception))

    def test_per_row_codes_served_transposed(self) -> None:
        """A Granularity.ROW parameter served as vLLM's per-channel method serves it: the live codes
        are the transpose of row-major [rows, cols] codes, the scales [rows, 1]; boxes hold whole rows."""
        spec = {"layer.weight": QuantizedParam("layer.weight_scale", Quantization(Fp8.E4M3FN, Granularity.ROW, arithmetic=Arithmetic.VLLM_CHANNEL), True)}
        receiver = RecordedReceiver(self.recording([Piece("q", (0, 0), (200, 256), 0, (256, 1)), Piece("k", (0, 0), (184, 256), 200 * 256, (256, 1))]), quantized=spec)
        codes, scales = torch.empty(384, 256, dtype=torch.float8_e4m3fn), torch.empty(384, 1)
        with refit.Table() as table:
            self.assertEqual(receiver.add_to(table, {"layer.weight": codes.t(), "layer.weight_scale": scales}, 0, 0), 2)
        with refit.Table() as table, self.assertRaises(refit.RefitError) as caught:
            receiver.add_to(table, {"layer.weight": codes, "layer.weight_scale": scales}, 0, 0)
        self.assertIn("quantized needs write [256, 384]/[1, 256]", str(caught.exception))
        with self.assertRaises(refit.RefitError) as caught:
            RecordedReceiver(self.recording([Piece("a", (0, 0), (384, 128), 0, (256, 1)), Piece("b", (0, 0), (384, 128), 128, (256, 1))]), quantized=spec)
        self.assertIn("a ends at row 384, column 128 of layer.weight, inside a block another box shares", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
