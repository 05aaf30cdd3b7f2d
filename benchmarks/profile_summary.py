"""Where the device time of a ``jax.profiler`` trace went, read offline (no device, no jax):
the top ops by device time, the same time grouped (matmul, attention, elementwise/norm,
collectives, copies, other), and the idle gaps on the device timeline between kernels.

    python benchmarks/profile_summary.py TRACE [--module jit_decode] [--top 20]
        [--start-ms A --end-ms B] [--device auto|gpu|cpu] [--device-id 0] [--gaps 10]
        [--xplane FILE | --no-hlo] [--json-only]

TRACE is a Chrome trace-event file (``perfetto_trace.json.gz`` or ``*.trace.json.gz``, as
``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes under
``dir/plugins/profile/<run>/``) or a directory to search for one (the newest run wins). Prints a
table, then ONE JSON line (``--json-only``: the line alone).

Which events count as the device:
  * gpu: every event on a ``/device:GPU:N`` process (one track per CUDA stream: compute,
    memset, H2D and D2H copies); ``--device-id N`` keeps one GPU.
  * cpu: XLA:CPU runs its ops on host threads; the events that carry ``hlo_op`` and
    ``hlo_module`` args (the thunk executor's) are its ops; ``--device-id N`` keeps
    ``device_ordinal`` N. Ops nest there (a ``while`` holds its body's ops), so each op is
    charged its self time.
  * auto (default): gpu when the trace has a device process with events, else cpu.

``--module`` keeps the events whose ``hlo_module`` contains the text, runs of ``_`` read as
one (``jit_decode`` keeps the engine's ``jit__decode_program``); ``--start-ms``/``--end-ms``
keep the events that start in that window, in ms from the trace's first event (the times
Perfetto shows). Both exist because a capture holds warm-up and other programs beside the
step of interest.

Figures: ``time`` is device time (self time on cpu); ``share`` its fraction of all selected
device time (the shares sum to 1; that is the busy time where kernels don't overlap);
``of_span`` its fraction of the wall span from the first kernel's start to the last kernel's
end. ``busy`` is the union of the kernels' intervals, ``gaps`` the rest of the span
(busy + gaps = span): time the device waited, on the host or on a dependency.

Bytes and FLOPs, where known: a copy or memset event's size arg (GPU); ``flops`` or
``bytes_accessed`` args if an event carries them (jax 0.10/0.11's XLA:CPU and XLA:GPU events
did not); else the compiled HLO that the ``*.xplane.pb`` beside the trace holds (read with a
small protobuf wire-format reader here: no protobuf package needed). From HLO: FLOPs are the
dots' (2 x result elements x contracted size; elementwise math, convolutions and custom calls
count none); bytes are operands read + result written, counting only the slices of an operand
that is only sliced, and only the update of an in-place dynamic-update-slice or scatter. An
event maps to its HLO op by name (XLA:GPU names a kernel after its fusion, ``.`` -> ``_``) or
by its ``hlo_op`` arg (XLA:CPU). Kernels that cuBLAS or cuDNN launch inside a CUDA graph
(``hlo_op: command_buffer_N``) map to no op: no bytes or FLOPs, grouped by their names. Where
the HLO is known it decides the group (a fusion holding a dot is matmul; one whose result is a
copy, transpose, slice or update is copies), except that a kernel named for attention stays
attention (cuDNN's attention kernels hold dots); without it names decide (``--no-hlo``).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys

GROUPS = ("matmul", "attention", "elementwise/norm", "collectives", "copies", "other")

# ---------------------------------------------------------------------------------------------
# Grouping by name. Patterns are searched in lowercased names, ``-`` and ``.`` read as ``_``,
# in this order: the first group whose pattern matches wins.
# ---------------------------------------------------------------------------------------------
def _token(word: str) -> str:
    """``word`` as a whole ``_``-separated token of a normalized name (a number may follow)."""
    return rf"(?:^|_){word}(?:$|_|\d)"


# CUPTI's names for transfers and memsets, and copy kernels: checked first, so that a memset
# inside, say, a cuDNN call is still a copy.
TRANSFER_PATTERN = re.compile(r"memcpy|memset|h2d|d2h|d2d|host_to_device|device_to_host")
COLLECTIVE_PATTERN = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
                                r"collective_permute|collective_broadcast|"
                                + _token("send") + "|" + _token("recv"))
# Attention before matmul: cuDNN's attention kernels have dots in their names. cuDNN serves
# attention here (XLA:GPU's convolutions would go through it too; LLMs have none).
ATTENTION_PATTERN = re.compile(r"attention|attn|flash|fmha|sdpa|paged|ragged|splash|cudnn|"
                               + _token("mha"))
MATMUL_PATTERN = re.compile(r"gemm|cublas|cutlass|wgmma|xmma|nvjet|matmul|convolution|"
                            + _token("dot") + "|" + _token("conv"))
COPY_PATTERN = re.compile(r"copy|transpose|slice|concatenate|gather|scatter|" + _token("pad"))
ELEMENTWISE_PATTERN = re.compile(r"^loop_|^input_|^wrapped_|fusion|reduce|norm|rope|rotary|"
                                 r"softmax|convert|broadcast|add|multiply|subtract|divide|exp|"
                                 r"tanh|rsqrt|sqrt|select|compare|maximum|minimum|iota|negate|"
                                 r"triton")


def _normalized(name: str) -> str:
    return re.sub(r"[-.\s]", "_", name.lower())


def group_by_name(name: str) -> str:
    """The group a kernel or op name alone suggests (XLA:GPU names kernels after their fusion:
    ``loop_*``/``input_*`` elementwise and reduction fusions, ``gemm_fusion_dot*``; cuBLAS
    ``sm90_xmma_gemm_*``, ``nvjet_*``; cuDNN ``cudnn_*sdpa*``; Pallas kernels after their
    function, e.g. ``paged_attention_*``)."""
    n = _normalized(name)
    for group, pattern in (("copies", TRANSFER_PATTERN), ("collectives", COLLECTIVE_PATTERN),
                           ("attention", ATTENTION_PATTERN), ("matmul", MATMUL_PATTERN),
                           ("copies", COPY_PATTERN), ("elementwise/norm", ELEMENTWISE_PATTERN)):
        if pattern.search(n):
            return group
    return "other"


# ---------------------------------------------------------------------------------------------
# The compiled HLO in the xplane.pb: a minimal protobuf wire-format reader.
# Field numbers are protobuf's compatibility contract, from xla/service/hlo.proto,
# xla/xla_data.proto and tsl/profiler/protobuf/xplane.proto.
# ---------------------------------------------------------------------------------------------
XSPACE_PLANES = 1
XPLANE_NAME, XPLANE_EVENT_METADATA, XPLANE_STAT_METADATA = 2, 4, 5
MAP_VALUE = 2  # a map entry is {1: key, 2: value}
XEVENT_METADATA_STATS = 5
XSTAT_METADATA_ID, XSTAT_BYTES = 1, 6
XSTAT_METADATA_NAME = 2
HLO_PROTO_MODULE = 1
MODULE_NAME, MODULE_COMPUTATIONS = 1, 3
COMPUTATION_INSTRUCTIONS, COMPUTATION_ID, COMPUTATION_ROOT_ID = 2, 5, 6
(INSTR_NAME, INSTR_OPCODE, INSTR_SHAPE, INSTR_PARAMETER_NUMBER, INSTR_CUSTOM_CALL_TARGET,
 INSTR_DOT_DIMS, INSTR_ID, INSTR_OPERAND_IDS, INSTR_CALLED_COMPUTATION_IDS) = \
    1, 2, 3, 9, 28, 30, 35, 36, 38
SHAPE_ELEMENT_TYPE, SHAPE_DIMENSIONS, SHAPE_TUPLE_SHAPES = 2, 3, 4
DOT_LHS_CONTRACTING = 1

# xla.PrimitiveType -> bits per element (TUPLE, TOKEN, OPAQUE hold no array data of their own)
ELEMENT_BITS = {1: 8, 2: 8, 3: 16, 4: 32, 5: 64, 6: 8, 7: 16, 8: 32, 9: 64, 10: 16, 11: 32,
                12: 64, 15: 64, 16: 16, 18: 128, 19: 8, 20: 8, 21: 4, 22: 4, 23: 8, 24: 8,
                25: 8, 26: 2, 27: 2, 28: 8, 29: 8, 30: 1, 31: 1, 32: 4, 33: 8}


def _varint(buf, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def proto_fields(buf):
    """Yield (field number, value) of one serialized message: an int for varints, a
    memoryview for length-delimited fields (sub-messages, strings, packed arrays), raw bytes
    for fixed-width ones."""
    buf = memoryview(buf)
    i, end = 0, len(buf)
    while i < end:
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire == 1:
            value, i = bytes(buf[i:i + 8]), i + 8
        elif wire == 5:
            value, i = bytes(buf[i:i + 4]), i + 4
        else:  # groups (3, 4) are not used by these protos
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, value


def _ints(value) -> list[int]:
    """A repeated integer field's one occurrence: packed (bytes) or a single varint."""
    if isinstance(value, int):
        return [value]
    out, i = [], 0
    while i < len(value):
        v, i = _varint(value, i)
        out.append(v)
    return out


def _message(buf) -> dict[int, list]:
    fields = collections.defaultdict(list)
    for field, value in proto_fields(buf):
        fields[field].append(value)
    return fields


def _text(value) -> str:
    return bytes(value).decode("utf-8", "replace")


@dataclasses.dataclass(frozen=True)
class Shape:
    element_bits: int
    dims: tuple[int, ...]
    parts: tuple["Shape", ...] = ()  # a tuple shape's elements

    @property
    def bytes(self) -> int:
        if self.parts:
            return sum(p.bytes for p in self.parts)
        elements = 1
        for d in self.dims:
            elements *= d
        return (elements * self.element_bits + 7) // 8


def _shape(buf) -> Shape:
    m = _message(buf)
    dims = tuple(d for v in m.get(SHAPE_DIMENSIONS, []) for d in _ints(v))
    element_type = m.get(SHAPE_ELEMENT_TYPE, [0])[0]
    return Shape(ELEMENT_BITS.get(element_type, 0), dims,
                 tuple(_shape(s) for s in m.get(SHAPE_TUPLE_SHAPES, [])))


@dataclasses.dataclass
class Instruction:
    id: int
    name: str
    opcode: str
    shape: Shape
    operand_ids: list[int]
    called_ids: list[int]
    custom_call_target: str = ""
    lhs_contracting: tuple[int, ...] = ()
    parameter_number: int = 0


def _instruction(buf) -> Instruction:
    m = _message(buf)
    dot = _message(m[INSTR_DOT_DIMS][0]) if INSTR_DOT_DIMS in m else {}
    return Instruction(
        id=m.get(INSTR_ID, [0])[0], name=_text(m[INSTR_NAME][0]), opcode=_text(m[INSTR_OPCODE][0]),
        shape=_shape(m[INSTR_SHAPE][0]) if INSTR_SHAPE in m else Shape(0, ()),
        operand_ids=[i for v in m.get(INSTR_OPERAND_IDS, []) for i in _ints(v)],
        called_ids=[i for v in m.get(INSTR_CALLED_COMPUTATION_IDS, []) for i in _ints(v)],
        custom_call_target=_text(m[INSTR_CUSTOM_CALL_TARGET][0])
        if INSTR_CUSTOM_CALL_TARGET in m else "",
        lhs_contracting=tuple(d for v in dot.get(DOT_LHS_CONTRACTING, []) for d in _ints(v)),
        parameter_number=m.get(INSTR_PARAMETER_NUMBER, [0])[0])


@dataclasses.dataclass
class HloModule:
    name: str
    instructions: dict[int, Instruction]          # by id (ids are unique in a module)
    computations: dict[int, tuple[list[int], int]]  # id -> (instruction ids, root id)

    def called_instructions(self, instr: Instruction):
        """Every instruction of the computations ``instr`` calls, recursively (a fusion's
        body, its reduce's reducer, a nested fusion's body)."""
        stack, seen = list(instr.called_ids), set()
        while stack:
            cid = stack.pop()
            if cid in seen or cid not in self.computations:
                continue
            seen.add(cid)
            for iid in self.computations[cid][0]:
                inner = self.instructions[iid]
                yield inner
                stack.extend(inner.called_ids)


def parse_hlo_module(buf) -> HloModule:
    module = _message(_message(buf)[HLO_PROTO_MODULE][0])
    instructions, computations = {}, {}
    for comp_buf in module.get(MODULE_COMPUTATIONS, []):
        comp = _message(comp_buf)
        ids = []
        for instr_buf in comp.get(COMPUTATION_INSTRUCTIONS, []):
            instr = _instruction(instr_buf)
            instructions[instr.id] = instr
            ids.append(instr.id)
        root = comp.get(COMPUTATION_ROOT_ID, [ids[-1] if ids else 0])[0]
        computations[comp.get(COMPUTATION_ID, [0])[0]] = (ids, root)
    return HloModule(_text(module[MODULE_NAME][0]), instructions, computations)


def hlo_modules_from_xplane(path: str) -> list[HloModule]:
    """The compiled HLO modules jax's profiler stores in the xplane's ``/host:metadata`` plane
    (one ``Hlo Proto`` stat per program). Only that plane is decoded."""
    with open(path, "rb") as f:
        space = f.read()
    modules = []
    for field, plane in proto_fields(space):
        if field != XSPACE_PLANES:
            continue
        # the name comes early in a plane: stop reading the (large) others there
        name = next((v for f, v in proto_fields(plane) if f == XPLANE_NAME), b"")
        if _text(name) != "/host:metadata":
            continue
        p = _message(plane)
        stat_names = {}
        for entry in p.get(XPLANE_STAT_METADATA, []):
            meta = _message(_message(entry)[MAP_VALUE][0])
            stat_names[meta.get(1, [0])[0]] = _text(meta.get(XSTAT_METADATA_NAME, [b""])[0])
        for entry in p.get(XPLANE_EVENT_METADATA, []):
            meta = _message(_message(entry)[MAP_VALUE][0])
            for stat_buf in meta.get(XEVENT_METADATA_STATS, []):
                stat = _message(stat_buf)
                if stat_names.get(stat.get(XSTAT_METADATA_ID, [0])[0]) == "Hlo Proto" \
                        and XSTAT_BYTES in stat:
                    modules.append(parse_hlo_module(stat[XSTAT_BYTES][0]))
    return modules


# What an HLO op does, by opcode.
MATMUL_OPCODES = {"dot", "convolution", "ragged-dot", "scaled-dot"}
COLLECTIVE_OPCODES = {"all-reduce", "all-reduce-start", "all-reduce-done", "all-gather",
                      "all-gather-start", "all-gather-done", "reduce-scatter", "all-to-all",
                      "ragged-all-to-all", "collective-permute", "collective-permute-start",
                      "collective-permute-done", "collective-broadcast"}
MOVEMENT_OPCODES = {"copy", "copy-start", "copy-done", "transpose", "dynamic-update-slice",
                    "dynamic-slice", "slice", "concatenate", "pad", "gather", "scatter",
                    "reshape", "bitcast", "reverse"}
OTHER_OPCODES = {"while", "conditional", "call", "sort", "rng", "rng-bit-generator",
                 "rng-get-and-update-state", "infeed", "outfeed", "send", "recv", "send-done",
                 "recv-done", "after-all", "async-start", "async-update", "async-done", "fft",
                 "triangular-solve", "cholesky", "top-k"}
# Ops that don't compute or move data themselves (looking through them to find a fusion root).
PLUMBING_OPCODES = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
IN_PLACE_UPDATE_OPERAND = {"dynamic-update-slice": 1, "scatter": 2}  # which operand is written


@dataclasses.dataclass(frozen=True)
class HloOpInfo:
    """What the compiled HLO says about one op: its group (None: let the name decide), the
    FLOPs of its dots (None: none), its bytes (operands + result; None: unknown)."""
    group: str | None
    flops: float | None
    bytes: float | None


def _dot_flops(module: HloModule, dot: Instruction) -> float:
    """2 x result elements x contracted size (a multiply and an add per term)."""
    lhs = module.instructions.get(dot.operand_ids[0]) if dot.operand_ids else None
    if lhs is None:
        return 0.0
    contracted = 1
    for d in dot.lhs_contracting:
        contracted *= lhs.shape.dims[d] if d < len(lhs.shape.dims) else 1
    result = 1
    for d in dot.shape.dims:
        result *= d
    return 2.0 * result * contracted


def _root_opcodes(module: HloModule, computation_id: int) -> set[str]:
    """The opcodes that produce a computation's result, looking through tuples and bitcasts."""
    _, root = module.computations.get(computation_id, ([], 0))
    out, stack, seen = set(), [root], set()
    while stack:
        instr = module.instructions.get(stack.pop())
        if instr is None or id(instr) in seen:
            continue
        seen.add(id(instr))
        if instr.opcode in ("tuple", "bitcast", "get-tuple-element"):
            stack.extend(instr.operand_ids)
        else:
            out.add(instr.opcode)
    return out


def _group_of(module: HloModule, instr: Instruction) -> str | None:
    op = instr.opcode
    if op == "fusion":
        inner = {i.opcode for i in module.called_instructions(instr)}
        if inner & MATMUL_OPCODES:
            return "matmul"
        if inner & COLLECTIVE_OPCODES:
            return "collectives"
        roots = set().union(*(_root_opcodes(module, c) for c in instr.called_ids)) \
            if instr.called_ids else set()
        if roots and roots <= MOVEMENT_OPCODES | PLUMBING_OPCODES:
            return "copies"
        return "elementwise/norm"
    if op == "custom-call":
        target = instr.custom_call_target
        target_group = group_by_name(target)
        # Pallas/Triton and other generic targets say nothing: the kernel's name decides.
        return target_group if target_group in ("matmul", "attention", "collectives") else None
    if op in MATMUL_OPCODES:
        return "matmul"
    if op in COLLECTIVE_OPCODES:
        return "collectives"
    if op in MOVEMENT_OPCODES:
        return "copies"
    if op in OTHER_OPCODES or op in PLUMBING_OPCODES:
        return "other"
    return "elementwise/norm"


SLICING_OPCODES = {"slice", "dynamic-slice", "gather"}  # read a part of their first operand
VIEW_OPCODES = {"bitcast", "reshape"}  # the same bytes, another shape


def _sliced_read(value_id: int, users: dict[int, list[Instruction]]) -> int | None:
    """Bytes read of a fused parameter that is only sliced (through views): the slices' sizes.
    None where something reads it whole."""
    total = 0
    for user in users.get(value_id, []):
        if user.opcode in VIEW_OPCODES:
            inner = _sliced_read(user.id, users)
            if inner is None:
                return None
            total += inner
        elif user.opcode in SLICING_OPCODES and user.operand_ids[0] == value_id:
            total += user.shape.bytes
        else:
            return None
    return total


def _in_place_updates(module: HloModule, root: Instruction) -> list[tuple[Instruction, int]]:
    """(update, aliased fused parameter number) for each in-place update among a fused body's
    outputs (the root, or a tuple root's elements)."""
    outputs = [module.instructions.get(i) for i in root.operand_ids] \
        if root.opcode == "tuple" else [root]
    found = []
    for out in outputs:
        if out is None or out.opcode not in IN_PLACE_UPDATE_OPERAND:
            continue
        target = module.instructions.get(out.operand_ids[0])
        k = IN_PLACE_UPDATE_OPERAND[out.opcode]
        update = module.instructions.get(out.operand_ids[k]) if len(out.operand_ids) > k else None
        if target is not None and target.opcode == "parameter" and update is not None:
            found.append((update, target.parameter_number))
    return found


def _bytes_of(module: HloModule, instr: Instruction) -> float | None:
    """Operands read + result written, counting what is touched: a sliced operand counts its
    slices; an in-place update (dynamic-update-slice, scatter; also a fusion's output) counts
    its update, not the buffer it aliases. Layout padding and caches are not modelled."""
    if instr.opcode in OTHER_OPCODES - {"sort", "fft", "triangular-solve", "cholesky", "top-k"}:
        return None  # control flow: its body's ops are the ones that move data
    operands = [module.instructions.get(i) for i in instr.operand_ids]
    if any(o is None for o in operands):
        return None
    reads = [o.shape.bytes for o in operands]
    written = instr.shape.bytes
    if instr.opcode in SLICING_OPCODES and reads:
        reads[0] = min(reads[0], written)
    elif instr.opcode in IN_PLACE_UPDATE_OPERAND and len(reads) > IN_PLACE_UPDATE_OPERAND[
            instr.opcode]:
        reads[0], written = 0, reads[IN_PLACE_UPDATE_OPERAND[instr.opcode]]
    elif instr.opcode == "fusion" and len(instr.called_ids) == 1 \
            and instr.called_ids[0] in module.computations:
        ids, root_id = module.computations[instr.called_ids[0]]
        body = [module.instructions[i] for i in ids]
        users: dict[int, list[Instruction]] = collections.defaultdict(list)
        for inner in body:
            for o in inner.operand_ids:
                users[o].append(inner)
        for param in body:
            if param.opcode == "parameter" and param.parameter_number < len(reads):
                sliced = _sliced_read(param.id, users)
                if sliced is not None:
                    reads[param.parameter_number] = min(reads[param.parameter_number], sliced)
        root = module.instructions.get(root_id)
        for update, number in (_in_place_updates(module, root) if root else []):
            if number < len(reads):
                written -= reads[number] - update.shape.bytes  # the buffer's size was counted
                reads[number] = 0
    return float(sum(reads) + max(written, 0))


def kernel_style(hlo_name: str) -> str:
    """An HLO op's name as XLA:GPU names its kernel (``loop_add_fusion.3`` ->
    ``loop_add_fusion_3``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", hlo_name)


def hlo_op_table(modules: list[HloModule]) -> dict[tuple[str, str], HloOpInfo]:
    """(module name, op name) -> HloOpInfo, for every op of every module, under its HLO name
    and the kernel-style name (``.`` and ``-`` -> ``_``). Programs compiled more than once under
    one name (other shapes) can disagree: then the figures are dropped (unknown) and the group
    kept only if they agree."""
    found: dict[tuple[str, str], set[HloOpInfo]] = collections.defaultdict(set)
    for module in modules:
        for instr in module.instructions.values():
            if instr.opcode in PLUMBING_OPCODES:
                continue
            if instr.opcode == "fusion":
                flops = sum(_dot_flops(module, i) for i in module.called_instructions(instr)
                            if i.opcode == "dot") or None
            else:
                flops = _dot_flops(module, instr) if instr.opcode == "dot" else None
            info = HloOpInfo(_group_of(module, instr), flops, _bytes_of(module, instr))
            for name in {instr.name, kernel_style(instr.name)}:
                found[(module.name, name)].add(info)
    table = {}
    for key, infos in found.items():
        if len(infos) == 1:
            table[key] = infos.pop()
        else:
            groups = {i.group for i in infos}
            table[key] = HloOpInfo(groups.pop() if len(groups) == 1 else None, None, None)
    return table


# ---------------------------------------------------------------------------------------------
# Reading the trace
# ---------------------------------------------------------------------------------------------
TRACE_NAMES = ("perfetto_trace.json.gz", "*.trace.json.gz", "perfetto_trace.json", "*.trace.json")


def find_trace_file(path: str) -> str:
    """``path`` itself if a file; else the newest trace file under it (Perfetto's first)."""
    if os.path.isfile(path):
        return path
    for pattern in TRACE_NAMES:
        found = glob.glob(os.path.join(path, "**", pattern), recursive=True)
        if found:
            # run folders are named by time (YYYY_MM_DD_HH_MM_SS): the newest sorts last
            return max(found, key=lambda p: (os.path.dirname(p), os.path.getmtime(p)))
    raise FileNotFoundError(f"no trace file ({', '.join(TRACE_NAMES)}) under {path}")


def load_trace_events(path: str) -> list[dict]:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    name: str
    start: float  # us, as in the trace
    dur: float    # us
    track: tuple  # (pid, tid)
    module: str
    hlo_op: str
    args: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def end(self) -> float:
        return self.start + self.dur


# Lines that profilers derive from the ops (not more ops): skipped on a device process.
DERIVED_LINES = re.compile(r"^(XLA Modules|Steps|Framework Ops|TensorFlow Ops|Framework Name "
                           r"Scope|Source code|XLA TraceMe|Launch Stats|TraceMe)")


def _track_names(events) -> tuple[dict, dict]:
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            processes[e.get("pid")] = e.get("args", {}).get("name", "")
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    return processes, threads


def _device_number(process_name: str) -> int | None:
    m = re.search(r":(\d+)$", process_name)
    return int(m.group(1)) if m else None


def select_device_events(events: list[dict], device: str = "auto", device_id: int | None = None
                         ) -> tuple[str, list[DeviceEvent], list[str]]:
    """(kind, the device's complete events, the names of their tracks)."""
    processes, threads = _track_names(events)
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    device_pids = {pid for pid, name in processes.items() if name.startswith("/device:")}
    if device_id is not None:
        device_pids = {p for p in device_pids if _device_number(processes[p]) == device_id}
    if device == "auto":
        device = "gpu" if any(e.get("pid") in device_pids for e in complete) else "cpu"
    if device == "gpu":
        tracks = {k for k in threads if k[0] in device_pids}
        op_lines = {k for k in tracks if threads[k] == "XLA Ops"}  # TPU-style: one ops line
        tracks = op_lines or {k for k in tracks if not DERIVED_LINES.match(threads[k])}
        chosen = [e for e in complete if (e.get("pid"), e.get("tid")) in tracks
                  or (e.get("pid") in device_pids and (e.get("pid"), e.get("tid")) not in threads)]
    else:
        chosen = [e for e in complete if "hlo_op" in e.get("args", {})
                  and "hlo_module" in e.get("args", {})
                  and (device_id is None or str(e["args"].get("device_ordinal")) == str(device_id))]
    out = []
    for e in chosen:
        args = e.get("args", {}) or {}
        out.append(DeviceEvent(name=e.get("name", ""), start=float(e["ts"]), dur=float(e["dur"]),
                               track=(e.get("pid"), e.get("tid")),
                               module=str(args.get("hlo_module", "")),
                               hlo_op=str(args.get("hlo_op", "")), args=args))
    out.sort(key=lambda d: (d.start, -d.dur))
    names = sorted({f"{processes.get(d.track[0], d.track[0])} / {threads.get(d.track, d.track[1])}"
                    for d in out})
    return device, out, names


def trace_origin(events: list[dict]) -> float:
    """The first event's time: the zero of --start-ms/--end-ms (Perfetto shows times from it)."""
    stamps = [float(e["ts"]) for e in events if "ts" in e and e.get("ph") != "M"]
    return min(stamps) if stamps else 0.0


def module_matches(wanted: str, module: str) -> bool:
    """``wanted`` is in the module's name, read with runs of ``_`` as one: jax names the jit of
    ``_decode_program`` ``jit__decode_program``, which ``jit_decode`` should find."""
    squeeze = lambda text: re.sub(r"_+", "_", text)  # noqa: E731
    return wanted in module or squeeze(wanted) in squeeze(module)


def restrict(events: list[DeviceEvent], module: str | None = None, start_us: float | None = None,
             end_us: float | None = None) -> list[DeviceEvent]:
    """The events of modules ``module`` matches, starting in [start_us, end_us)."""
    return [e for e in events
            if (module is None or module_matches(module, e.module))
            and (start_us is None or e.start >= start_us)
            and (end_us is None or e.start < end_us)]


# ---------------------------------------------------------------------------------------------
# Time accounting
# ---------------------------------------------------------------------------------------------
NESTING_SLACK_US = 1e-3


def self_times(events: list[DeviceEvent]) -> list[float]:
    """Each event's duration less its direct children's on the same track (an XLA:CPU
    ``while`` holds its body's ops): every microsecond counted once."""
    own = [e.dur for e in events]
    open_by_track: dict[tuple, list[int]] = collections.defaultdict(list)
    order = sorted(range(len(events)), key=lambda k: (events[k].start, -events[k].dur))
    for i in order:
        e = events[i]
        stack = open_by_track[e.track]  # the open events enclosing this one, innermost last
        # Close what ended before it, and what it sticks out of (a sibling, not a parent; the
        # slack absorbs the timestamps' rounding).
        while stack and (events[stack[-1]].end <= e.start
                         or e.end > events[stack[-1]].end + NESTING_SLACK_US):
            stack.pop()
        if stack:
            own[stack[-1]] -= e.dur
        stack.append(i)
    return [max(t, 0.0) for t in own]


@dataclasses.dataclass(frozen=True)
class Gap:
    start: float  # us
    dur: float
    after: str    # the op that ended just before
    before: str   # the op that starts just after


def busy_intervals(events: list[DeviceEvent]) -> list[tuple[float, float, str, str]]:
    """The union of the events' intervals: (start, end, first op, op that ends it), sorted."""
    merged: list[list] = []
    for e in sorted(events, key=lambda d: d.start):
        if merged and e.start <= merged[-1][1]:
            if e.end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = e.end, e.name
        else:
            merged.append([e.start, e.end, e.name, e.name])
    return [tuple(m) for m in merged]


def gaps_between(intervals) -> list[Gap]:
    return [Gap(a[1], b[0] - a[1], a[3], b[2]) for a, b in zip(intervals, intervals[1:])]


# ---------------------------------------------------------------------------------------------
# The summary
# ---------------------------------------------------------------------------------------------
SIZE_ARG = re.compile(r"(?:\bsize|num_bytes):(\d+)")


def event_bytes_and_flops(e: DeviceEvent, info: HloOpInfo | None
                          ) -> tuple[float | None, float | None]:
    """The event's own args first (a transfer's size; flops/bytes if the profiler wrote them),
    then the HLO's."""
    args = e.args
    nbytes = flops = None
    for key in ("bytes_accessed", "bytes", "raw_bytes_accessed"):
        if key in args:
            try:
                nbytes = float(args[key])
                break
            except (TypeError, ValueError):
                pass
    if nbytes is None:
        details = args.get("memcpy_details") or args.get("Memset_details") or ""
        m = SIZE_ARG.search(str(details))
        if m:
            nbytes = float(m.group(1))
    for key in ("flops", "model_flops"):
        if key in args:
            try:
                flops = float(args[key])
                break
            except (TypeError, ValueError):
                pass
    if info is not None:
        nbytes = info.bytes if nbytes is None else nbytes
        flops = info.flops if flops is None else flops
    return nbytes, flops


def display_name(name: str) -> str:
    """A C++ kernel's name without its return type and parameter list."""
    short = re.sub(r"^void\s+", "", name)
    if "(" in short:
        short = short[:short.index("(")]
    return short


def lookup_hlo(e: DeviceEvent, table: dict) -> HloOpInfo | None:
    """The HLO op an event ran: by its name (a GPU kernel's is its fusion's), else its hlo_op
    arg (XLA:CPU's ops; GPU ops outside CUDA graphs)."""
    for name in (e.name, e.hlo_op):
        for key in ((e.module, name), (e.module, kernel_style(name))):
            if key in table:
                return table[key]
    return None


def group_of_event(e: DeviceEvent, info: HloOpInfo | None) -> str:
    """Attention and transfers by name first (cuDNN's attention kernels contain dots; a copy is
    a copy whatever op launched it), then what the HLO says, then the names."""
    by_name = group_by_name(e.name)
    if by_name in ("attention", "collectives") or TRANSFER_PATTERN.search(_normalized(e.name)):
        return by_name
    if info is not None and info.group is not None:
        return info.group
    if by_name == "other" and e.hlo_op:
        return group_by_name(e.hlo_op)
    return by_name


@dataclasses.dataclass
class Tally:
    """Totals of a set of events: device time (us), count, bytes and FLOPs where known."""
    time: float = 0.0
    count: int = 0
    bytes: float | None = None
    flops: float | None = None
    time_with_flops: float = 0.0  # the part of `time` whose FLOPs are known (for TFLOP/s)
    time_with_bytes: float = 0.0

    def add(self, time: float, nbytes: float | None, flops: float | None):
        self.time += time
        self.count += 1
        if nbytes is not None:
            self.bytes = (self.bytes or 0.0) + nbytes
            self.time_with_bytes += time
        if flops is not None:
            self.flops = (self.flops or 0.0) + flops
            self.time_with_flops += time

    def as_dict(self, total: float, span: float) -> dict:
        d = {"time_us": round(self.time, 3), "count": self.count,
             "share": round(self.time / total, 6) if total else 0.0,
             "of_span": round(self.time / span, 6) if span else 0.0,
             "bytes": self.bytes, "flops": self.flops}
        if self.flops and self.time_with_flops:
            d["tflop_per_s"] = round(self.flops / self.time_with_flops / 1e6, 3)
        if self.bytes and self.time_with_bytes:
            d["gb_per_s"] = round(self.bytes / self.time_with_bytes / 1e3, 3)
        return d


def summarize(events: list[DeviceEvent], hlo_table: dict | None = None, *, nested: bool = False,
              top: int = 20, largest_gaps: int = 10, origin_us: float | None = None) -> dict:
    """The summary of the selected device events, JSON-ready. ``nested``: charge self time
    (XLA:CPU's ops nest; a GPU stream's kernels don't, and their timestamps can overlap by a
    fraction of a microsecond, which must not read as nesting). ``origin_us``: the zero of
    the times reported (default: the first event's start)."""
    hlo_table = hlo_table or {}
    times = self_times(events) if nested else [e.dur for e in events]
    total = sum(times)
    intervals = busy_intervals(events)
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    busy = sum(b - a for a, b, _, _ in intervals)
    gaps = gaps_between(intervals)
    groups = {g: Tally() for g in GROUPS}
    ops: dict[tuple[str, str], Tally] = collections.defaultdict(Tally)
    op_group = {}
    modules: dict[str, Tally] = collections.defaultdict(Tally)
    for e, t in zip(events, times):
        info = lookup_hlo(e, hlo_table)
        group = group_of_event(e, info)
        nbytes, flops = event_bytes_and_flops(e, info)
        groups[group].add(t, nbytes, flops)
        key = (e.module, display_name(e.name))
        ops[key].add(t, nbytes, flops)
        op_group[key] = group
        modules[e.module or "-"].add(t, nbytes, flops)
    ranked = sorted(ops.items(), key=lambda kv: -kv[1].time)[:top]
    gap_list = sorted(gaps, key=lambda g: -g.dur)[:largest_gaps]
    first = intervals[0][0] if intervals else 0.0
    origin = first if origin_us is None else origin_us
    return {
        "events": len(events), "span_us": round(span, 3), "busy_us": round(busy, 3),
        "busy_fraction": round(busy / span, 6) if span else 0.0,
        "device_time_us": round(total, 3), "first_event_at_us": round(first - origin, 3),
        "modules": {m: {"time_us": round(t.time, 3), "count": t.count}
                    for m, t in sorted(modules.items(), key=lambda kv: -kv[1].time)},
        "groups": {g: groups[g].as_dict(total, span) for g in GROUPS},
        "top_ops": [{"op": name, "module": module, "group": op_group[(module, name)],
                     **tally.as_dict(total, span)} for (module, name), tally in ranked],
        "gaps": {"total_us": round(sum(g.dur for g in gaps), 3), "count": len(gaps),
                 "largest_us": round(gap_list[0].dur, 3) if gap_list else 0.0,
                 "largest": [{"at_us": round(g.start - origin, 3), "gap_us": round(g.dur, 3),
                              "after": display_name(g.after), "before": display_name(g.before)}
                             for g in gap_list]},
    }


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def _fmt(value, scale=1.0, digits=2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "~"


def format_table(s: dict) -> str:
    lines = [f"trace: {s['trace']}",
             f"device: {s['device']}  tracks: {'; '.join(s['tracks']) or '-'}",
             f"module filter: {s['module_filter'] or '-'}  window (ms): {s['window_ms'] or '-'}  "
             f"HLO from: {s['hlo_source'] or '-'}",
             "modules (device ms): " + (", ".join(f"{m} {d['time_us'] / 1e3:.3f}" for m, d
                                                  in s["modules"].items()) or "-"),
             f"first event at {s['first_event_at_us'] / 1e3:.3f} ms  "
             f"span {s['span_us'] / 1e3:.3f} ms  busy {s['busy_us'] / 1e3:.3f} ms "
             f"({100 * s['busy_fraction']:.1f}%)  events {s['events']}  gaps {s['gaps']['count']}"
             f" totalling {s['gaps']['total_us'] / 1e3:.3f} ms (largest "
             f"{s['gaps']['largest_us']:.1f} us)", ""]
    head = f"{'group':<18}{'time_ms':>10}{'share':>8}{'of_span':>9}{'count':>8}{'GFLOP':>10}" \
           f"{'TFLOP/s':>9}{'MB':>10}{'GB/s':>8}"
    lines += [head, "-" * len(head)]
    for g, d in s["groups"].items():
        lines.append(f"{g:<18}{d['time_us'] / 1e3:>10.3f}{d['share']:>8.3f}{d['of_span']:>9.3f}"
                     f"{d['count']:>8}{_fmt(d['flops'], 1e9, 3):>10}"
                     f"{_fmt(d.get('tflop_per_s'), 1, 1):>9}{_fmt(d['bytes'], 1e6, 2):>10}"
                     f"{_fmt(d.get('gb_per_s'), 1, 0):>8}")
    lines += ["", f"top {len(s['top_ops'])} ops by device time"]
    head = f"{'op':<48}{'group':<17}{'module':<20}{'count':>6}{'time_ms':>10}{'share':>7}" \
           f"{'avg_us':>9}{'GFLOP':>9}{'TFLOP/s':>8}{'MB':>9}{'GB/s':>7}"
    lines += [head, "-" * len(head)]
    for d in s["top_ops"]:
        lines.append(f"{_clip(d['op'], 47):<48}{d['group']:<17}{_clip(d['module'], 19):<20}"
                     f"{d['count']:>6}{d['time_us'] / 1e3:>10.3f}{d['share']:>7.3f}"
                     f"{d['time_us'] / d['count']:>9.1f}{_fmt(d['flops'], 1e9, 3):>9}"
                     f"{_fmt(d.get('tflop_per_s'), 1, 1):>8}{_fmt(d['bytes'], 1e6, 2):>9}"
                     f"{_fmt(d.get('gb_per_s'), 1, 0):>7}")
    if s["gaps"]["largest"]:
        lines += ["", "largest gaps (at: ms from the trace's start, as --start-ms reads)"]
        for g in s["gaps"]["largest"]:
            lines.append(f"  at {g['at_us'] / 1e3:>10.3f} ms {g['gap_us']:>10.1f} us   "
                         f"{_clip(g['after'], 40)} -> {_clip(g['before'], 40)}")
    return "\n".join(lines)


def build_summary(trace: str, *, module: str | None = None, start_ms: float | None = None,
                  end_ms: float | None = None, device: str = "auto", device_id: int | None = None,
                  xplane: str | None = None, use_hlo: bool = True, top: int = 20,
                  largest_gaps: int = 10) -> dict:
    """Everything ``main`` prints, from a trace file or a folder holding one."""
    path = find_trace_file(trace)
    raw = load_trace_events(path)
    kind, events, tracks = select_device_events(raw, device, device_id)
    origin = trace_origin(raw)
    events = restrict(events, module,
                      None if start_ms is None else origin + 1e3 * start_ms,
                      None if end_ms is None else origin + 1e3 * end_ms)
    hlo_source, table = None, {}
    if use_hlo:
        candidates = [xplane] if xplane else sorted(glob.glob(os.path.join(
            os.path.dirname(os.path.abspath(path)), "*.xplane.pb")))
        modules = []
        for candidate in candidates:
            try:
                modules += hlo_modules_from_xplane(candidate)
            except (OSError, ValueError, KeyError, IndexError) as err:  # a file we can't read
                print(f"profile_summary: skipping HLO from {candidate}: {err!r}", file=sys.stderr)
        if modules:
            table = hlo_op_table(modules)
            hlo_source = ", ".join(os.path.basename(c) for c in candidates)
    summary = summarize(events, table, nested=kind != "gpu", top=top, largest_gaps=largest_gaps,
                        origin_us=origin)
    window = None if start_ms is None and end_ms is None else [start_ms, end_ms]
    return {"benchmark": "profile_summary", "trace": path, "device": kind, "tracks": tracks,
            "module_filter": module, "window_ms": window, "hlo_source": hlo_source, **summary}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a *.trace.json.gz / perfetto_trace.json.gz or a folder")
    parser.add_argument("--module", default=None,
                        help="keep ops of HLO modules whose name contains this (e.g. jit_decode)")
    parser.add_argument("--start-ms", type=float, default=None,
                        help="keep events starting at or after this (ms from the trace's start)")
    parser.add_argument("--end-ms", type=float, default=None,
                        help="keep events starting before this (ms from the trace's start)")
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                        help="which tracks are the device (module docstring)")
    parser.add_argument("--device-id", type=int, default=None,
                        help="one device: /device:GPU:N, or XLA:CPU device_ordinal N")
    parser.add_argument("--top", type=int, default=20, help="ops to list")
    parser.add_argument("--gaps", type=int, default=10, help="largest gaps to list")
    parser.add_argument("--xplane", default=None,
                        help="the *.xplane.pb to read HLO from (default: beside the trace)")
    parser.add_argument("--no-hlo", action="store_true", help="group by names alone")
    parser.add_argument("--json-only", action="store_true", help="print the JSON line alone")
    args = parser.parse_args(argv)
    summary = build_summary(args.trace, module=args.module, start_ms=args.start_ms,
                            end_ms=args.end_ms, device=args.device, device_id=args.device_id,
                            xplane=args.xplane, use_hlo=not args.no_hlo, top=args.top,
                            largest_gaps=args.gaps)
    if not args.json_only:
        print(format_table(summary))
        print()
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
