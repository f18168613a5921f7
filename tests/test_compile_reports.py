"""What `gdngen.compilers` reads from a compiled program's text, on HLO lines of the form
libtpu writes (no compiler needed)."""

from __future__ import annotations

from gdngen import compilers


def _mosaic_line(name: str, window: tuple, used: tuple) -> str:
    def configs(offset, size):
        return f'[{{"memory_space":"1","offset":"{offset}","size":"{size}"}}]'

    return (f'  %{name} = (f32[8,128]{{1,0}}) custom-call(f32[8,128]{{1,0}} %p), '
            f'custom_call_target="tpu_custom_call", backend_config={{"scoped_memory_configs":'
            f'{configs(*window)},"used_scoped_memory_configs":{configs(*used)}}}')


def test_a_kernels_vmem_is_counted_from_its_scoped_window():
    """XLA may put a kernel's scoped VMEM window above other buffers (here at 32 MiB) and then
    state the used range from 0: the kernel's own use is the range's end less the window's
    start (as measured: Kimi heads' per-channel chunk program at T = 1024 on v5e, 991232 bytes
    of intra-chunk kernel above a 32 MiB window), the limit the window's size."""
    MiB = 1 << 20
    text = "\n".join([_mosaic_line("at_zero", (0, 16 * MiB), (0, 1056768)),
                      _mosaic_line("above", (32 * MiB, 16 * MiB), (0, 32 * MiB + 991232)),
                      "  %other = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)"])
    assert compilers.mosaic_kernels(text) == [
        {"name": "at_zero", "vmem_used": 1056768, "vmem_limit": 16 * MiB},
        {"name": "above", "vmem_used": 991232, "vmem_limit": 16 * MiB}]
