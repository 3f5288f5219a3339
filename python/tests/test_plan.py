"""Tables, their wire encoding and plans. A small hand-made refit (two ranks each publishing a full
replica, each receiving a tensor-parallel column half) is planned, its routes executed by a Python
memmove loop over the segments, and the receivers' bytes compared with ones built element by
element in Python."""

import ctypes
import unittest

from refit import Plan, PlanStats, Policy, RefitError, Route, RouteKind, Segment, Status, Table, _lib

ROWS, COLS, HALF = 4, 8, 4
W_ELEM, B_ELEM = 4, 2  # bytes per element of the weight and the bias
POISON = 0xEE


def pattern(size, seed):
    return bytes((seed * 31 + i * 7 + (i >> 8)) % 251 for i in range(size))


def element(data, index, elem_size):
    return data[index * elem_size : (index + 1) * elem_size]


class Buffer:
    """Host memory standing for one endpoint's device memory."""

    def __init__(self, size, content=None):
        self.memory = (ctypes.c_uint8 * size)(*(content or [POISON] * size))
        self.addr = ctypes.addressof(self.memory)
        self.size = size

    def bytes(self):
        return bytes(self.memory)

    def holds(self, addr, length):
        return self.addr <= addr and addr + length <= self.addr + self.size


def execute(routes):
    """Runs every contiguous run of every segment with memmove (all endpoints share this process)."""
    for route in routes:
        for segment in route.segments:
            for src, dst, length in segment.runs():
                ctypes.memmove(dst, src, length)


class Refit:
    """Ranks 0 and 1 each hold the whole weight w [4, 8] (4-byte elements) and bias b [8] (2-byte
    elements) on device 0, and receive on device 1 their column half of w and half of b; rank 0
    also receives w transposed, whole."""

    def __init__(self, digests=(7, 7)):
        self.w = pattern(ROWS * COLS * W_ELEM, 1)
        self.b = pattern(COLS * B_ELEM, 2)
        self.published = [(Buffer(len(self.w), self.w), Buffer(len(self.b), self.b)) for _ in range(2)]
        self.halves = [Buffer(ROWS * HALF * W_ELEM) for _ in range(2)]
        self.bias_halves = [Buffer(HALF * B_ELEM) for _ in range(2)]
        self.transposed = Buffer(len(self.w))
        self.tables = [Table(), Table()]
        for rank, table in enumerate(self.tables):
            if rank == 1:
                table.add_tensor("unrelated", [3], 1)  # so that "w" has another index here
            w = table.add_tensor("w", [ROWS, COLS], W_ELEM, dtype=1)
            b = table.add_tensor("b", [COLS], B_ELEM, dtype=2)
            self.assert_index = (w, b)
            w_buffer, b_buffer = self.published[rank]
            table.add_offer(w, rank, 0, w_buffer.addr, [0, 0], [ROWS, COLS], digest=digests[rank])
            table.add_offer(b, rank, 0, b_buffer.addr, [0], [COLS], strides=[1])
            table.add_need(w, rank, 1, self.halves[rank].addr, [0, rank * HALF], [ROWS, HALF], [HALF, 1])
            table.add_need(b, rank, 1, self.bias_halves[rank].addr, [rank * HALF], [HALF], [1])
            if rank == 0:
                # Destination [COLS, ROWS]: dimension 0 is the tensor's 1, dimension 1 its 0.
                table.add_need(w, 0, 1, self.transposed.addr, [0, 0], [ROWS, COLS], [ROWS, 1], perm=[1, 0])

    def close(self):
        for table in self.tables:
            table.close()

    def expected_half(self, rank):
        return b"".join(
            element(self.w, row * COLS + rank * HALF + col, W_ELEM)
            for row in range(ROWS)
            for col in range(HALF)
        )

    def expected_bias_half(self, rank):
        return b"".join(element(self.b, rank * HALF + i, B_ELEM) for i in range(HALF))

    def expected_transposed(self):
        columns_first = (row * COLS + col for col in range(COLS) for row in range(ROWS))
        return b"".join(element(self.w, index, W_ELEM) for index in columns_first)

    def needed_bytes(self):
        return 2 * (ROWS * HALF * W_ELEM + HALF * B_ELEM) + len(self.w)

    def endpoint_buffers(self, rank, device):
        if device == 0:
            return self.published[rank]
        extra = (self.transposed,) if rank == 0 else ()
        return (self.halves[rank], self.bias_halves[rank]) + extra


class PlanTest(unittest.TestCase):
    def setUp(self):
        self.refit = Refit()

    def tearDown(self):
        self.refit.close()

    def assert_received(self):
        for rank in range(2):
            self.assertEqual(self.refit.halves[rank].bytes(), self.refit.expected_half(rank), rank)
            self.assertEqual(self.refit.bias_halves[rank].bytes(), self.refit.expected_bias_half(rank))
        self.assertEqual(self.refit.transposed.bytes(), self.refit.expected_transposed())

    def assert_routes_stay_in_their_endpoints(self, routes):
        for route in routes:
            self.assertIsInstance(route, Route)
            sources = self.refit.endpoint_buffers(route.src_rank, route.src_device)
            targets = self.refit.endpoint_buffers(route.dst_rank, route.dst_device)
            for segment in route.segments:
                self.assertIsInstance(segment, Segment)
                for src, dst, length in segment.runs():
                    self.assertTrue(any(buffer.holds(src, length) for buffer in sources), route)
                    self.assertTrue(any(buffer.holds(dst, length) for buffer in targets), route)

    def test_local_policy_reads_the_replica_of_each_receivers_rank(self):
        with Plan.build(self.refit.tables, policy=Policy.LOCAL) as plan:
            routes = plan.routes()
            self.assertEqual(list(plan), routes)
        self.assertEqual(
            [(r.src_rank, r.src_device, r.dst_rank, r.dst_device, r.kind) for r in routes],
            [(0, 0, 0, 1, RouteKind.PEER), (1, 0, 1, 1, RouteKind.PEER)],
        )
        self.assert_routes_stay_in_their_endpoints(routes)
        execute(routes)
        self.assert_received()

    def test_first_policy_reads_rank_0_only(self):
        with Plan.build(self.refit.tables, policy=Policy.FIRST) as plan:
            routes = plan.routes()
            stats = plan.stats
        self.assertEqual({(r.src_rank, r.src_device) for r in routes}, {(0, 0)})
        self.assertEqual({(r.dst_rank, r.kind) for r in routes}, {(0, RouteKind.PEER), (1, RouteKind.REMOTE)})
        self.assertEqual(stats.bytes_remote, ROWS * HALF * W_ELEM + HALF * B_ELEM)
        self.assertEqual(stats.bytes_peer, self.refit.needed_bytes() - stats.bytes_remote)
        self.assertEqual(stats.bytes_local, 0)
        self.assert_routes_stay_in_their_endpoints(routes)
        execute(routes)
        self.assert_received()

    def test_balanced_policy_and_no_coalescing_move_the_same_bytes(self):
        for policy, coalesce in ((Policy.BALANCED, True), (Policy.LOCAL, False)):
            with self.subTest(policy=policy.name, coalesce=coalesce):
                refit = self.refit = Refit()
                with Plan.build(refit.tables, policy=policy, coalesce=coalesce) as plan:
                    routes = plan.routes()
                self.assert_routes_stay_in_their_endpoints(routes)
                execute(routes)
                self.assert_received()
                refit.close()

    def test_stats_agree_with_the_routes(self):
        with Plan.build(self.refit.tables) as plan:
            stats = plan.stats
            routes = plan.routes()
            receiver = plan.receiver_stats(1, 1)
            nobody = plan.receiver_stats(5, 5)
        self.assertIsInstance(stats, PlanStats)
        segments = [segment for route in routes for segment in route.segments]
        self.assertEqual(stats.needed_bytes, self.refit.needed_bytes())
        self.assertEqual(sum(segment.bytes for segment in segments), stats.needed_bytes)
        self.assertEqual(len(segments), stats.ranges_coalesced)
        self.assertEqual(sum(len(list(segment.runs())) for segment in segments), stats.flat_runs_coalesced)
        self.assertEqual(sum(stats.size_histogram), stats.ranges_coalesced)
        self.assertEqual(len(stats.size_histogram), 64)
        self.assertEqual((stats.offers_in, stats.replica_sets, stats.needs), (4, 2, 5))
        self.assertEqual(stats.bytes_all_replicas, 2 * stats.needed_bytes)
        self.assertEqual(stats.duplicate_bytes_dropped, stats.needed_bytes)
        self.assertEqual(stats.routes, len(routes))
        self.assertEqual(stats.bytes_peer, stats.needed_bytes)
        self.assertEqual(receiver.needed_bytes, ROWS * HALF * W_ELEM + HALF * B_ELEM)
        self.assertEqual(receiver.routes, 1)
        self.assertEqual((nobody.needed_bytes, nobody.routes, nobody.offers_in), (0, 0, 4))

    def test_coalescing_joins_adjacent_boxes(self):
        # Two offers of row halves, adjacent in memory, needed as one contiguous tensor.
        source = Buffer(ROWS * COLS * W_ELEM, pattern(ROWS * COLS * W_ELEM, 3))
        half = ROWS // 2 * COLS * W_ELEM
        for coalesce, segments in ((True, 1), (False, 2)):
            with self.subTest(coalesce=coalesce), Table() as table:
                target = Buffer(source.size)
                tensor = table.add_tensor("w", [ROWS, COLS], W_ELEM)
                table.add_offer(tensor, 0, 0, source.addr, [0, 0], [ROWS // 2, COLS])
                table.add_offer(tensor, 0, 0, source.addr + half, [ROWS // 2, 0], [ROWS // 2, COLS])
                table.add_need(tensor, 1, 0, target.addr, [0, 0], [ROWS, COLS], [COLS, 1])
                with Plan.build([table], coalesce=coalesce) as plan:
                    routes = plan.routes()
                    self.assertEqual(plan.stats.ranges_coalesced, segments)
                self.assertEqual(sum(len(route.segments) for route in routes), segments)
                execute(routes)
                self.assertEqual(target.bytes(), source.bytes())

    def test_fingerprint_is_the_same_in_any_order_and_through_the_wire(self):
        with Plan.build(self.refit.tables) as plan:
            fingerprint = plan.fingerprint
        with Plan.build(reversed(self.refit.tables)) as plan:
            self.assertEqual(plan.fingerprint, fingerprint)
        decoded = [Table.decode(table.encode()) for table in self.refit.tables]
        with Plan.build(decoded) as plan:
            self.assertEqual(plan.fingerprint, fingerprint)
            execute(plan.routes())
        self.assert_received()
        with Plan.build(self.refit.tables, policy=Policy.FIRST) as plan:
            self.assertNotEqual(plan.fingerprint, fingerprint)
        for table in decoded:
            table.close()

    def test_each_process_share_holds_its_routes_of_the_whole_plan(self):
        with Plan.build(self.refit.tables, policy=Policy.FIRST) as whole:
            routes, inputs = whole.routes(), whole.inputs_fingerprint
            for process in range(4):
                with self.subTest(process=process):
                    with Plan.build_share(self.refit.tables, process, policy=Policy.FIRST) as share:
                        mine = [r for r in routes if process in (r.src_rank, r.dst_rank)]
                        self.assertEqual(share.routes(), mine)
                        self.assertEqual(share.inputs_fingerprint, inputs)
        with Plan.build(self.refit.tables, policy=Policy.LOCAL) as local:
            self.assertNotEqual(local.inputs_fingerprint, inputs)
        with self.assertRaises(RefitError) as caught:
            Plan.build_share(self.refit.tables, 0, policy=5)
        self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)

    def test_reading_a_plan(self):
        plan = Plan.build(self.refit.tables)
        self.assertEqual(plan.route_count, 2)
        with self.assertRaises(RefitError) as caught:
            plan.route(2)
        self.assertIs(caught.exception.status, Status.NOT_FOUND)
        with self.assertRaises(RefitError) as caught:
            plan.route(-1)
        self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
        for rank, device in [(-1, 0), (0, 1 << 32)]:
            with self.assertRaises(RefitError) as caught:
                plan.receiver_stats(rank, device)
            self.assertIs(caught.exception.status, Status.INVALID_ARGUMENT)
        route = plan.route(0)
        plan.close()
        plan.close()
        self.assertGreater(route.segments[0].len, 0)  # copied out: still readable
        readers = {
            "stats": lambda: plan.stats,
            "receiver_stats": lambda: plan.receiver_stats(0, 0),
            "fingerprint": lambda: plan.fingerprint,
            "route_count": lambda: plan.route_count,
            "route": lambda: plan.route(0),
        }
        for name, read in readers.items():
            with self.subTest(reader=name):
                with self.assertRaises(RefitError) as caught:
                    read()
                self.assertIs(caught.exception.status, Status.INVALID_STATE)

    def test_tables_without_needs_make_an_empty_plan(self):
        table = Table()
        tensor = table.add_tensor("w", [ROWS, COLS], W_ELEM)
        table.add_offer(tensor, 0, 0, 4096, [0, 0], [ROWS, COLS])
        with Plan.build([table]) as plan, Plan.build([]) as empty:
            self.assertEqual(plan.routes(), [])
            self.assertEqual(plan.stats.needed_bytes, 0)
            self.assertEqual(empty.route_count, 0)
        table.close()


class SegmentTest(unittest.TestCase):
    def test_runs_follow_for_each_run(self):
        segment = Segment(src=1000, dst=5000, len=3, count=(2, 3), src_stride=(10, 100), dst_stride=(4, 50))
        self.assertEqual(
            list(segment.runs()),
            [(1000 + j * 100 + i * 10, 5000 + j * 50 + i * 4, 3) for j in range(3) for i in range(2)],
        )
        self.assertEqual(segment.bytes, 18)
        self.assertEqual(list(Segment(1, 2, 0, (5, 5), (0, 0), (0, 0)).runs()), [])
        self.assertEqual(list(Segment(1, 2, 8, (0, 1), (0, 0), (0, 0)).runs()), [])


class PlanErrorTest(unittest.TestCase):
    def assert_build_fails(self, status, tables, text=None, **options):
        with self.assertRaises(RefitError) as caught:
            Plan.build(tables, **options)
        self.assertIs(caught.exception.status, status)
        if text is not None:
            self.assertIn(text, caught.exception.message)

    def test_replica_mismatch(self):
        refit = Refit(digests=(7, 8))
        self.assert_build_fails(Status.REPLICA_MISMATCH, refit.tables, "'w'")
        refit.close()

    def test_coverage_gap_overlap_and_tensor_mismatch(self):
        with Table() as table:
            tensor = table.add_tensor("v", [ROWS + 2, COLS], 4)
            table.add_offer(tensor, 0, 0, 4096, [0, 0], [2, COLS])
            table.add_need(tensor, 1, 0, 1 << 20, [0, 0], [ROWS, COLS], [COLS, 1])
            self.assert_build_fails(Status.COVERAGE_GAP, [table], "offset [2, 0] extent [2, 8]")
            table.add_offer(tensor, 0, 0, 8192, [2, 0], [2, COLS])
            Plan.build([table]).close()
            table.add_need(tensor, 1, 0, (1 << 20) + 16, [0, 0], [2, COLS], [COLS, 1])
            self.assert_build_fails(Status.OVERLAP, [table])
            with Table() as other:
                other.add_tensor("v", [ROWS + 2, COLS], 2)
                self.assert_build_fails(Status.TENSOR_MISMATCH, [table, other], "element size")

    def test_bad_options_and_closed_tables(self):
        refit = Refit()
        self.assert_build_fails(Status.INVALID_ARGUMENT, refit.tables, "policy", policy=3)
        # coalesce is a byte that must be 0 or 1; the binding only writes those, so the C call is
        # made directly.
        options = _lib.PlanOptions()
        self.assertEqual(_lib.lib.refit_plan_options_init(ctypes.byref(options)), Status.SUCCESS)
        pointers = (ctypes.c_void_p * len(refit.tables))(*[table.handle for table in refit.tables])
        plan = ctypes.c_void_p()
        for byte, status in ((0x7F, Status.INVALID_ARGUMENT), (2, Status.INVALID_ARGUMENT), (0, Status.SUCCESS)):
            options.coalesce = byte
            got = _lib.lib.refit_plan_build(pointers, len(refit.tables), ctypes.byref(options), ctypes.byref(plan))
            self.assertEqual(got, status, byte)
        self.assertIn(b"coalesce", _lib.lib.refit_last_error_message())
        _lib.lib.refit_plan_destroy(plan)
        refit.tables[1].close()
        self.assert_build_fails(Status.INVALID_STATE, refit.tables, "closed")
        refit.close()


class TableTest(unittest.TestCase):
    def setUp(self):
        self.table = Table()
        self.w = self.table.add_tensor("w", [ROWS, COLS], W_ELEM, dtype=1)

    def tearDown(self):
        self.table.close()

    def assert_fails(self, status, call, text=None):
        with self.assertRaises(RefitError) as caught:
            call()
        self.assertIs(caught.exception.status, status)
        if text is not None:
            self.assertIn(text, caught.exception.message)

    def test_tensor_indices_and_mismatches(self):
        add = self.table.add_tensor
        self.assertEqual(add("w", [ROWS, COLS], W_ELEM, dtype=1), self.w)
        self.assertEqual(add(b"other", [], 8), self.w + 1)
        cases = [
            (Status.TENSOR_MISMATCH, ("w", [ROWS, COLS + 1], W_ELEM, 1), "[4, 9]"),
            (Status.TENSOR_MISMATCH, ("w", [ROWS, COLS], W_ELEM, 2), "dtype"),
            (Status.INVALID_ARGUMENT, ("", [1], 4), "name"),
            (Status.INVALID_ARGUMENT, ("a\0b", [1], 4), "NUL"),
            (Status.INVALID_ARGUMENT, (b"\xff", [1], 4), "UTF-8"),
            (Status.INVALID_ARGUMENT, ("z", [1], 0), "elem"),
            (Status.INVALID_ARGUMENT, ("z", [1] * 9, 4), None),
            (Status.INVALID_ARGUMENT, ("z", [-1], 4), "shape"),
            (Status.INVALID_ARGUMENT, ("z", [1], 4, 1 << 32), "dtype"),
        ]
        for status, args, text in cases:
            with self.subTest(args=args):
                self.assert_fails(status, lambda: add(*args), text)

    def test_offer_and_need_arguments(self):
        whole = ([0, 0], [ROWS, COLS])
        offer, need, w = self.table.add_offer, self.table.add_need, self.w
        offers = [
            (Status.INVALID_ARGUMENT, lambda: offer(5, 0, 0, 64, *whole), "tensor"),
            (Status.TENSOR_MISMATCH, lambda: offer(w, 0, 0, 64, [0, 0], [ROWS, COLS + 1]), None),
            (Status.TENSOR_MISMATCH, lambda: offer(w, 0, 0, 64, [0], [ROWS]), None),
            (Status.INVALID_ARGUMENT, lambda: offer(w, 0, 0, 64, [0, 0], [ROWS]), "extent"),
            (Status.INVALID_ARGUMENT, lambda: offer(w, 0, 0, 64, *whole, strides=[1]), "strides"),
            (Status.INVALID_ARGUMENT, lambda: offer(w, 0, 0, (1 << 64) - 8, *whole), None),
            (Status.INVALID_ARGUMENT, lambda: offer(w, 0, 0, 64, *whole, digest=-1), "digest"),
        ]
        needs = [
            (Status.INVALID_ARGUMENT, lambda: need(9, 1, 0, 64, *whole, [COLS, 1]), "tensor"),
            (Status.INVALID_ARGUMENT, lambda: need(w, 1, 0, 64, *whole, [1, 1], perm=[0, 0]), "permutation"),
            (Status.INVALID_ARGUMENT, lambda: need(w, 1, 0, 64, *whole, [1, 1], perm=[0]), "perm"),
            (Status.INVALID_ARGUMENT, lambda: need(w, 1, 0, 64, *whole, [1]), "strides"),
            (Status.TENSOR_MISMATCH, lambda: need(w, 1, 0, 64, [1, 0], [ROWS, COLS], [COLS, 1]), None),
        ]
        for number, (status, call, text) in enumerate(offers + needs):
            with self.subTest(case=number):
                self.assert_fails(status, call, text)
        offer(w, 0, 0, 64, *whole, strides=[COLS, 1], digest=3)
        need(w, 1, 0, 4096, *whole, [ROWS, 1], perm=[1, 0])

    def test_encode_decode_round_trip_and_hostile_bytes(self):
        self.table.add_offer(self.w, 0, 0, 64, [0, 0], [ROWS, COLS], digest=11)
        self.table.add_need(self.w, 3, 1, 1 << 30, [0, HALF], [ROWS, HALF], [HALF, 1])
        data = self.table.encode()
        self.assertIsInstance(data, bytes)
        with Table.decode(data) as decoded:
            self.assertEqual(decoded.encode(), data)
            # The decoded table knows the tensor by the same index and description.
            self.assertEqual(decoded.add_tensor("w", [ROWS, COLS], W_ELEM, dtype=1), self.w)
        with Table.decode(bytearray(data)) as decoded:
            self.assertEqual(decoded.encode(), data)
        self.assertNotEqual(Table().encode(), data)

        def corrupt(position, value=None):
            changed = bytearray(data)
            changed[position] = changed[position] ^ 0x40 if value is None else value
            return bytes(changed)

        self.assert_fails(Status.DECODE_ERROR, lambda: Table.decode(data[:-1]))
        self.assert_fails(Status.DECODE_ERROR, lambda: Table.decode(corrupt(len(data) // 2)))
        self.assert_fails(Status.VERSION_MISMATCH, lambda: Table.decode(corrupt(4, 99)))
        self.assert_fails(Status.DECODE_ERROR, lambda: Table.decode(b""))

    def test_closed_table(self):
        table = Table()
        table.close()
        self.assert_fails(Status.INVALID_STATE, lambda: table.add_tensor("w", [1], 1), "closed")
        self.assert_fails(Status.INVALID_STATE, table.encode)


if __name__ == "__main__":
    unittest.main()
