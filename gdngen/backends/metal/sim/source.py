"""The kernel source ``mx.fast.metal_kernel`` builds, reproduced for the simulator.

`kernel_source` follows MLX 0.32's ``write_signature`` / ``write_template`` (mlx/fast.cpp): the
header, then ``template <...>`` from the template args, ``[[kernel]] void custom_kernel_<name>...``
with one ``const device T*`` (``constant`` below 8 elements, ``const constant T&`` for 0-d)
parameter per input plus ``<in>_shape`` / ``_strides`` / ``_ndim`` when the body mentions them,
``device T*`` outputs, the thread-position attributes the body mentions, the body, and the
explicit instantiation. `simulator_source` adds what only the simulator needs around that text:
the threadgroup-variable rewrite and the C entry points the runtime calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

#: Metal attributes MLX adds to the signature when the body mentions them (name -> type).
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# How the trampoline computes each attribute from the runtime's msl_rt_thread `t`.
_ATTRIBUTE_VALUES = {
    "dispatch_quadgroups_per_threadgroup":
        "(t->dispatch_threads_per_threadgroup[0] * t->dispatch_threads_per_threadgroup[1]"
        " * t->dispatch_threads_per_threadgroup[2] + 3) / 4",
    "dispatch_simdgroups_per_threadgroup":
        "(t->dispatch_threads_per_threadgroup[0] * t->dispatch_threads_per_threadgroup[1]"
        " * t->dispatch_threads_per_threadgroup[2] + 31) / 32",
    "dispatch_threads_per_threadgroup": "msl_sim::u3(t->dispatch_threads_per_threadgroup)",
    "grid_origin": "uint3(0u, 0u, 0u)",
    "grid_size": "msl_sim::u3(t->threads_per_grid)",
    "quadgroup_index_in_threadgroup": "t->thread_index_in_threadgroup / 4",
    "quadgroups_per_threadgroup":
        "(t->threads_per_threadgroup[0] * t->threads_per_threadgroup[1]"
        " * t->threads_per_threadgroup[2] + 3) / 4",
    "simdgroup_index_in_threadgroup": "t->simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "t->simdgroups_per_threadgroup",
    "thread_execution_width": "32u",
    "thread_index_in_quadgroup": "t->thread_index_in_threadgroup % 4",
    "thread_index_in_simdgroup": "t->thread_index_in_simdgroup",
    "thread_index_in_threadgroup": "t->thread_index_in_threadgroup",
    "thread_position_in_grid": "msl_sim::u3(t->thread_position_in_grid)",
    "thread_position_in_threadgroup": "msl_sim::u3(t->thread_position_in_threadgroup)",
    "threadgroup_position_in_grid": "msl_sim::u3(t->threadgroup_position_in_grid)",
    "threadgroups_per_grid": "msl_sim::u3(t->threadgroups_per_grid)",
    "threads_per_grid": "msl_sim::u3(t->threads_per_grid)",
    "threads_per_simdgroup": "32u",
    "threads_per_threadgroup": "msl_sim::u3(t->threads_per_threadgroup)",
}

# Inputs with fewer elements are passed in the constant address space (MLX's rule).
MAX_CONSTANT_ARRAY_SIZE = 8

_TYPE_STRINGS = {
    "float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "bool": "bool",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
}


def dtype_name(dtype) -> str:
    """Canonical dtype name (``"float32"``, ``"bfloat16"`` ...) of a NumPy / ml_dtypes dtype, an
    ``mx.Dtype`` or a name."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("mlx"):
        name = str(dtype).replace("mlx.core.", "")
    else:
        name = np.dtype(dtype).name
    if name not in _TYPE_STRINGS:
        raise ValueError(f"dtype must be one of {sorted(_TYPE_STRINGS)}, got {dtype!r}")
    return name


def type_string(dtype) -> str:
    """MLX's Metal type string of a dtype (``get_type_string``)."""
    return _TYPE_STRINGS[dtype_name(dtype)]


@dataclass(frozen=True)
class InputInfo:
    """What the signature needs to know about one input array."""

    name: str
    dtype: str
    ndim: int
    size: int
    uses_shape: bool
    uses_strides: bool
    uses_ndim: bool


@dataclass(frozen=True)
class KernelText:
    """A generated kernel: its MLX name, full source, parameters and attributes in order."""

    kernel_name: str
    source: str
    template_def: str
    inputs: tuple
    output_names: tuple
    output_dtypes: tuple
    attributes: tuple
    atomic_outputs: bool


def _template_value(value) -> tuple[str, str]:
    """(parameter type, value text) of one template arg: bool, int or a dtype."""
    if isinstance(value, (bool, np.bool_)):
        return "bool", "1" if value else "0"
    if isinstance(value, (int, np.integer)):
        return "int", str(int(value))
    return "typename", type_string(value)


def kernel_source(name: str, input_names, output_names, source: str, header: str,
                  inputs: list[tuple], output_dtypes, template=(),
                  atomic_outputs: bool = False) -> KernelText:
    """The source MLX compiles for one call of a ``metal_kernel``.

    ``inputs``: ``(dtype, ndim, size)`` per input, in ``input_names`` order; ``template``:
    ``(name, value)`` pairs with int, bool or dtype values.
    """
    if len(inputs) != len(input_names):
        raise ValueError(f"inputs has {len(inputs)} entries, expected {len(input_names)}")
    if len(output_dtypes) != len(output_names):
        raise ValueError(f"output_dtypes has {len(output_dtypes)} entries, expected "
                         f"{len(output_names)}")
    if not output_names:
        raise ValueError("output_names must name at least one output")
    infos = tuple(
        InputInfo(n, dtype_name(dt), int(ndim), int(size), f"{n}_shape" in source,
                  f"{n}_strides" in source, f"{n}_ndim" in source)
        for n, (dt, ndim, size) in zip(input_names, inputs))
    attributes = tuple((a, t) for a, t in METAL_ATTRIBUTES if a in source)
    out_dtypes = tuple(dtype_name(d) for d in output_dtypes)

    kernel_name = "custom_kernel_" + name
    template_def = ""
    if template:
        parts = [_template_value(v) for _, v in template]
        template_def = "<" + ", ".join(text for _, text in parts) + ">"
        template_hash = re.sub(r"<|>|(, )", "_", template_def)[:-1]
        kernel_name += "_" + template_hash
    for info in infos:
        kernel_name += "_" + _TYPE_STRINGS[info.dtype]
        if info.ndim == 0:
            kernel_name += "s"
        elif info.size < MAX_CONSTANT_ARRAY_SIZE:
            kernel_name += "c"
    for dt in out_dtypes:
        kernel_name += "_" + _TYPE_STRINGS[dt]

    text = header
    if template:
        params = [f"{_template_value(v)[0]} {n}" for n, v in template]
        text += "template <" + ", ".join(params) + ">\n"
    text += "[[kernel]] void " + kernel_name + "(\n"
    index = 0
    for info in infos:
        location = "constant" if info.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if info.ndim == 0 else "*"
        text += (f"  const {location} {_TYPE_STRINGS[info.dtype]}{ref} {info.name} "
                 f"[[buffer({index})]],\n")
        index += 1
        if info.ndim > 0:
            if info.uses_shape:
                text += f"  const constant int* {info.name}_shape [[buffer({index})]],\n"
                index += 1
            if info.uses_strides:
                text += f"  const constant int64_t* {info.name}_strides [[buffer({index})]],\n"
                index += 1
            if info.uses_ndim:
                text += f"  const constant int& {info.name}_ndim [[buffer({index})]],\n"
                index += 1
    for out_name, dt in zip(output_names, out_dtypes):
        tstr = _TYPE_STRINGS[dt]
        if atomic_outputs:
            tstr = f"atomic<{tstr}>"
        text += f"  device {tstr}* {out_name} [[buffer({index})]]"
        # MLX compares the buffer index (which counts shape/stride buffers) with the number of
        # inputs + outputs; reproduced as is.
        if index < len(infos) + len(output_names) - 1 or attributes:
            text += ",\n"
        else:
            text += ") {\n"
        index += 1
    for i, (attr, atype) in enumerate(attributes):
        text += f"  {atype} {attr} [[{attr}]]"
        text += ",\n" if i < len(attributes) - 1 else ") {\n"
    text += source
    text += "\n}\n"
    if template:
        full = kernel_name + template_def
        text += (f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({full}) '
                 f"{full};\n")
    return KernelText(kernel_name, text, template_def, infos, tuple(output_names), out_dtypes,
                      attributes, atomic_outputs)


# ------------------------------------------------------------------------ simulator additions

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_THREADGROUP = re.compile(r"\bthreadgroup\b(?!_)")
_CLOSE = {"(": ")", "[": "]", "{": "}"}


def _statement(text: str, start: int, end: int) -> tuple[int, str] | None:
    """The text from ``start`` to the ``;`` ending its statement (brackets balanced), or None
    when a bracket closes or a ``,`` / ``{`` / ``)`` comes first (a parameter, a cast ...)."""
    depth, angles, in_head = [], 0, True  # template brackets count only before the dims
    for i in range(start, end):
        ch = text[i]
        if ch in _CLOSE:
            if not depth and ch in "({":
                return None
            in_head = in_head and ch != "["
            depth.append(_CLOSE[ch])
        elif ch in ")]}":
            if not depth or depth.pop() != ch:
                return None
        elif in_head and not depth and ch in "<>":
            angles += 1 if ch == "<" else -1
        elif not depth and not angles and ch in ",;":
            if ch == ",":
                if in_head and not re.search(r"[*&]", text[start:i]):
                    raise ValueError("the Metal simulator needs one threadgroup variable per "
                                     f"declaration: threadgroup{text[start:i + 1]} ...")
                return None
            return i, text[start:i]
    return None


def _outside_angles(head: str) -> str:
    out, level = [], 0
    for ch in head:
        level += ch == "<"
        if level == 0:
            out.append(ch)
        level -= ch == ">" and level > 0
    return "".join(out)


def rewrite_threadgroup_variables(text: str) -> str:
    """Turn threadgroup *variable declarations* into references to the simulator's per
    threadgroup arena: ``threadgroup float tile[C * 8];`` becomes
    ``float (&tile)[C * 8] = *reinterpret_cast<float (*)[C * 8]>(msl_rt_threadgroup_var(...))``
    (same storage for every thread of the threadgroup, poisoned, bounds-checked by red zones).
    Pointer and reference uses (``threadgroup float* p``) keep the keyword, which the shim
    defines as empty. Text in comments is left alone.
    """
    spans, last = [], 0
    for m in _COMMENT.finditer(text):
        spans.append((last, m.start()))
        last = m.end()
    spans.append((last, len(text)))
    out, pos, ident = [], 0, 0
    for start, end in spans:
        for m in _THREADGROUP.finditer(text, start, end):
            stmt = _statement(text, m.end(), end)
            if stmt is None:
                continue
            stop, body = stmt
            cut = min((i for i in (body.find("["), body.find("=")) if i >= 0), default=len(body))
            head, dims = body[:cut].strip(), body[cut:].strip()
            if re.search(r"[*&()]", head) or "," in _outside_angles(head) or dims.startswith("="):
                continue
            found = re.match(r"(?s)(.*?)\s*\b([A-Za-z_]\w*)$", head)
            if not found or not found.group(1).strip():
                continue
            vtype, name = found.group(1).strip(), found.group(2)
            if dims:
                decl = (f"{vtype} (&{name}){dims} = *reinterpret_cast<{vtype} (*){dims}>("
                        f"msl_rt_threadgroup_var(sizeof({vtype}{dims}), alignof({vtype}), "
                        f'{ident}, "{name}"))')
            else:
                decl = (f"{vtype}& {name} = *reinterpret_cast<{vtype}*>(msl_rt_threadgroup_var("
                        f'sizeof({vtype}), alignof({vtype}), {ident}, "{name}"))')
            ident += 1
            out.append(text[pos:m.start()])
            out.append(decl.replace("\n", " "))
            pos = stop
    out.append(text[pos:])
    return "".join(out)


def simulator_source(kt: KernelText) -> str:
    """``kt.source`` (threadgroup variables rewritten, see `rewrite_threadgroup_variables`)
    plus the runtime's C entry point ``msl_sim_thread(args)``, which calls the kernel with one
    buffer per parameter and the current thread's attributes."""
    args, i = [], 0
    for info in kt.inputs:
        tstr = _TYPE_STRINGS[info.dtype]
        if info.ndim == 0:
            args.append(f"*static_cast<const {tstr}*>(a[{i}])")
        else:
            args.append(f"static_cast<const {tstr}*>(a[{i}])")
        i += 1
        if info.ndim > 0:
            for used, ctype in ((info.uses_shape, "const int*"),
                                (info.uses_strides, "const int64_t*"),
                                (info.uses_ndim, None)):
                if not used:
                    continue
                args.append(f"static_cast<{ctype}>(a[{i}])" if ctype
                            else f"*static_cast<const int*>(a[{i}])")
                i += 1
    for dt in kt.output_dtypes:
        tstr = _TYPE_STRINGS[dt]
        if kt.atomic_outputs:
            tstr = f"atomic<{tstr}>"
        args.append(f"static_cast<{tstr}*>(a[{i}])")
        i += 1
    for attr, _ in kt.attributes:
        args.append(_ATTRIBUTE_VALUES[attr])
    call = kt.kernel_name + kt.template_def
    arg_text = ",\n      ".join(args)
    entry = (
        "\n// ---- gdngen.backends.metal.sim entry points\n"
        'extern "C" void msl_sim_thread(void* const* a) {\n'
        "  const msl_rt_thread* t = msl_rt_self();\n"
        "  (void)t;\n"
        f"  {call}(\n      {arg_text});\n"
        "}\n"
    )
    return rewrite_threadgroup_variables(kt.source) + entry
