"""The binding against include/refit.h: every function, struct, constant and status the header
declares is declared alike in refit._lib, so the binding cannot silently fall behind the C API."""

import ctypes
import re
import unittest
from ctypes import POINTER, c_bool, c_char_p, c_int32, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from pathlib import Path

import refit
from refit import _lib

HEADER = Path(__file__).resolve().parents[2] / "include" / "refit.h"

# Handles are opaque to the binding: c_void_p whatever they point to.
HANDLES = ("refit_group", "refit_table", "refit_plan", "refit_prepared_copy", "refit_executor", "refit_comm")
STRUCTS = {
    "refit_comm_options": _lib.CommOptions,
    "refit_comm_id": _lib.CommId,
    "refit_group_options": _lib.GroupOptions,
    "refit_plan_options": _lib.PlanOptions,
    "refit_plan_stats": _lib.PlanStatsStruct,
    "refit_segment": _lib.SegmentStruct,
    "refit_route_info": _lib.RouteInfo,
    "refit_executor_options": _lib.ExecutorOptions,
    "refit_run_stats": _lib.RunStatsStruct,
    "refit_executor_info": _lib.ExecutorInfoStruct,
    "refit_quantization": _lib.QuantizationStruct,
    "refit_quantize_job": _lib.QuantizeJobStruct,
    "refit_need_quantization": _lib.NeedQuantizationStruct,
    "refit_quant_route_info": _lib.QuantRouteInfo,
}
SCALARS = {
    "void": None,
    "bool": c_bool,
    "uint8_t": c_uint8,
    "int32_t": c_int32,
    "uint32_t": c_uint32,
    "uint64_t": c_uint64,
    "size_t": c_size_t,
    "refit_status": _lib.status_t,
    "refit_rank_callback": _lib.RankCallback,
    "refit_log_callback": _lib.LogCallback,
}
# Header #define groups and the Python enum each must equal exactly.
ENUMS = {
    "REFIT_ALLGATHER_": refit.Algorithm,
    "REFIT_ARITHMETIC_": refit.Arithmetic,
    "REFIT_ARM_": refit.Arm,
    "REFIT_BACKEND_": refit.Backend,
    "REFIT_COMMIT_": refit.Commit,
    "REFIT_COPY_": refit.CopyFlag,
    "REFIT_EXIT_": refit.ExitMode,
    "REFIT_FP8_": refit.Fp8,
    "REFIT_PATH_": refit.QuantPath,
    "REFIT_POLICY_": refit.Policy,
    "REFIT_QUANT_": refit.Granularity,
    "REFIT_ROUTE_": refit.RouteKind,
    "REFIT_SOURCE_": refit.SourceType,
}
SINGLE_CONSTANTS = {
    "REFIT_MAX_DIMS": refit.MAX_DIMS,
    "REFIT_PLAN_SIZE_BUCKETS": refit.PLAN_SIZE_BUCKETS,
    "REFIT_ABI_VERSION": refit.ABI_VERSION,
    "REFIT_COMM_ID_BYTES": refit.COMM_ID_BYTES,
}


def header_code():
    """The header without comments."""
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def ctype_of(c_type):
    """The ctypes type the binding must use for a C type written as in the header ("const
    uint64_t *", "refit_table **", "void *const *"). Raises KeyError for a type not mapped here."""
    c_type = c_type.replace("const", " ").strip()
    depth = c_type.count("*")
    base = c_type.replace("*", " ").strip()
    if base in HANDLES or (base == "void" and depth > 0):
        depth -= 1
        target = c_void_p
    elif base == "char" and depth == 1:
        return c_char_p
    elif base in STRUCTS:
        target = STRUCTS[base]
    else:
        target = SCALARS[base]
    for _ in range(depth):
        target = POINTER(target)
    return target


def declared_functions():
    """name -> (return C type, [parameter C types]) for every function the header declares."""
    functions = {}
    pattern = re.compile(r"([A-Za-z_][\w \*]*?)\s*\b(refit_\w+)\s*\(([^()]*)\)\s*;")
    for match in pattern.finditer(header_code()):
        result, name, params = match.groups()
        params = " ".join(params.split())
        types = []
        if params not in ("", "void"):
            for param in params.split(","):
                # Drop the parameter name: the last identifier.
                types.append(re.sub(r"\b\w+\s*$", "", param.strip()).strip())
        functions[name] = (" ".join(result.split()), types)
    return functions


def declared_structs():
    """name -> [(field, C type, array length or None)] for every typedef struct with a body."""
    structs = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+)\s*;", header_code(), flags=re.S):
        fields = []
        for declaration in body.split(";"):
            declaration = " ".join(declaration.split())
            if not declaration:
                continue
            match = re.fullmatch(r"(.*?)\s*\b(\w+)\s*(?:\[(\w+)\])?", declaration)
            c_type, field, length = match.groups()
            fields.append((field, c_type, int(length) if length else None))
        structs[name] = fields
    return structs


def declared_defines():
    defines = re.findall(r"#define (REFIT_\w+) (\d+)\b", HEADER.read_text())
    return {name: int(value) for name, value in defines}


class HeaderTest(unittest.TestCase):
    def test_header_is_found_and_parsed(self):
        # Guards the tests below against a parser that silently finds nothing.
        self.assertTrue(HEADER.exists(), HEADER)
        functions = declared_functions()
        self.assertGreater(len(functions), 30)
        self.assertEqual(
            functions["refit_table_add_need"][1],
            [
                "refit_table *",
                "uint32_t",
                "uint32_t",
                "uint32_t",
                "uint64_t",
                "const uint64_t *",
                "const uint64_t *",
                "const uint32_t *",
                "const uint64_t *",
                "size_t",
            ],
        )
        self.assertEqual(functions["refit_version"], ("const char *", []))
        self.assertIn(("size_histogram", "uint64_t", 64), declared_structs()["refit_plan_stats"])

    def test_every_header_function_is_declared_and_nothing_else(self):
        header = set(declared_functions())
        binding = set(_lib.FUNCTIONS)
        self.assertEqual(header - binding, set(), "declared in refit.h, missing from refit._lib.FUNCTIONS")
        self.assertEqual(binding - header, set(), "declared in refit._lib.FUNCTIONS, not in refit.h")

    def test_every_signature_matches_the_header(self):
        for name, (result, params) in declared_functions().items():
            with self.subTest(function=name):
                restype, argtypes = _lib.FUNCTIONS[name]
                self.assertIs(restype, ctype_of(result))
                self.assertEqual(len(argtypes), len(params), params)
                for position, (argtype, param) in enumerate(zip(argtypes, params)):
                    self.assertIs(argtype, ctype_of(param), f"parameter {position}: {param}")
                # ...and they are what the loaded library's functions actually use.
                function = getattr(_lib.lib, name)
                self.assertIs(function.restype, restype)
                self.assertEqual(function.argtypes, argtypes)

    def test_every_struct_matches_the_header(self):
        structs = declared_structs()
        self.assertEqual(set(structs), set(STRUCTS))
        for name, fields in structs.items():
            with self.subTest(struct=name):
                bound = STRUCTS[name]._fields_
                self.assertEqual([f[0] for f in bound], [f[0] for f in fields])
                for (field, c_type, length), (_, ctype) in zip(fields, bound):
                    expected = ctype_of(c_type)
                    if length is not None:
                        self.assertEqual((ctype._type_, ctype._length_), (expected, length), field)
                    else:
                        self.assertIs(ctype, expected, field)

    def test_options_sizes_agree_with_the_library(self):
        # The library's *_options_init writes sizeof as Rust lays the struct out.
        options = _lib.GroupOptions()
        _lib.check(_lib.lib.refit_group_options_init(ctypes.byref(options)))
        self.assertEqual(options.size, ctypes.sizeof(_lib.GroupOptions))
        plan_options = _lib.PlanOptions()
        _lib.check(_lib.lib.refit_plan_options_init(ctypes.byref(plan_options)))
        self.assertEqual(plan_options.size, ctypes.sizeof(_lib.PlanOptions))
        executor_options = _lib.ExecutorOptions()
        _lib.check(_lib.lib.refit_executor_options_init(ctypes.byref(executor_options)))
        self.assertEqual(executor_options.size, ctypes.sizeof(_lib.ExecutorOptions))
        self.assertEqual((options.backend, options.host_devices), (refit.Backend.AUTO, 0))
        self.assertEqual((plan_options.policy, plan_options.coalesce), (refit.Policy.LOCAL, True))
        comm_options = _lib.CommOptions()
        _lib.check(_lib.lib.refit_comm_options_init(ctypes.byref(comm_options)))
        self.assertEqual(comm_options.size, ctypes.sizeof(_lib.CommOptions))
        self.assertEqual((comm_options.timeout_ms, comm_options.staging_bytes), (600_000, 256 << 20))

    def test_every_constant_matches_the_header(self):
        defines = declared_defines()
        for prefix, enum_type in ENUMS.items():
            with self.subTest(group=prefix):
                header = {n[len(prefix):]: value for n, value in defines.items() if n.startswith(prefix)}
                self.assertEqual(header, {member.name: member.value for member in enum_type})
        for name, value in SINGLE_CONSTANTS.items():
            self.assertEqual(defines[name], value, name)
        bound = set(SINGLE_CONSTANTS) | {n for n in defines if n.startswith(tuple(ENUMS))}
        unbound = {n for n in defines if n not in bound and not n.startswith("REFIT_VERSION_")}
        self.assertEqual(unbound, set(), "header constants the binding does not mirror")

    def test_statuses_match_the_header(self):
        header = dict(re.findall(r"REFIT_STATUS_(\w+) = (\d+)", header_code()))
        self.assertGreater(len(header), 20)
        self.assertEqual({name: int(value) for name, value in header.items()}, dict(refit.Status.__members__))


if __name__ == "__main__":
    unittest.main()
