"""gdngen.jaxcompat: the supported jax range (refused outside it at import, named in one place
that pyproject's extras agree with) and a CPU host's quiet start with libtpu installed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gdngen import jaxcompat

ROOT = Path(__file__).resolve().parent.parent

#: what libtpu prints when it starts on a host without a TPU and without its single-host settings
LIBTPU_NOISE = ("E0000", "TPU_WORKER_HOSTNAMES", "Failed to find host bounds",
                "could not determine TPU")

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install 'gdngen[tpu]')")
no_tpu_here = pytest.mark.skipif(jaxcompat.tpu_attached(),
                                 reason="a TPU is attached: jax starts its TPU platform here")


# ------------------------------------------------------------------------------ versions


@pytest.mark.parametrize(("jax_version", "jaxlib_version"), [
    ("0.10.2", "0.10.2"), ("0.11.2", "0.11.2"), ("0.12.0.1", "0.12.0.1"),
    ("0.12.0.1", "0.11.2"), ("0.10.0.dev20260101", "0.10.0")])
def test_supported_releases_pass(jax_version, jaxlib_version):
    jaxcompat.check_versions(jax_version, jaxlib_version)


@pytest.mark.parametrize(("jax_version", "jaxlib_version", "named"), [
    ("0.9.2", "0.9.2", "jax 0.9.2 and jaxlib 0.9.2"),
    ("0.13.0", "0.13.0", "jax 0.13.0 and jaxlib 0.13.0"),
    ("0.12.0.1", "0.13.0", "jaxlib 0.13.0 is installed"),
    ("1.0.0", "0.12.0", "jax 1.0.0 is installed")])
def test_unsupported_release_names_installed_and_supported(jax_version, jaxlib_version, named):
    with pytest.raises(jaxcompat.UnsupportedJax) as info:
        jaxcompat.check_versions(jax_version, jaxlib_version)
    message = str(info.value)
    assert named in message
    assert "jax and jaxlib 0.10 through 0.12" in message
    assert isinstance(info.value, ImportError)


def test_release_rejects_a_version_without_major_minor():
    assert jaxcompat.release("0.12.0.1") == (0, 12)
    with pytest.raises(ValueError, match="major.minor"):
        jaxcompat.release("latest")


def test_installed_jax_is_supported():
    jax = jaxcompat.require()
    assert jaxcompat.SUPPORTED[0] <= jaxcompat.release(jax.__version__) <= jaxcompat.SUPPORTED[1]


def test_import_of_the_jax_side_refuses_an_unsupported_jax():
    """``import gdngen.jax`` with a jax that says it is 0.13.0: one UnsupportedJax at the import,
    naming both versions (not an AttributeError at the first call)."""
    code = ("import jax; jax.__version__ = '0.13.0'\n"
            "import gdngen.jax")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=_clean_env(), check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gdngen.jaxcompat.UnsupportedJax: "), proc.stderr[-2000:]
    assert "jax 0.13.0" in last and "0.10 through 0.12" in last


def test_pyproject_extras_take_the_supported_range():
    """The jax, tpu and cuda extras accept exactly `SUPPORTED`'s releases."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (lo_major, lo_minor), (hi_major, hi_minor) = jaxcompat.SUPPORTED
    wanted = f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"
    extras = project["optional-dependencies"]
    pins = {}
    for extra in ("jax", "tpu", "cuda"):
        for requirement in extras[extra]:
            match = re.match(r"(jax\[[\w-]+\]|jaxlib|jax)([<>=!]\S*?)\s*(;|$)", requirement)
            if match:
                pins[f"{extra}: {match.group(1)}"] = match.group(2)
    assert pins == {"jax: jax": wanted, "jax: jaxlib": wanted, "tpu: jax[tpu]": wanted,
                    "cuda: jax[cuda12-local]": wanted}
    # jax 0.10 (the lowest) needs Python 3.11
    assert project["requires-python"] == ">=3.11"


# ------------------------------------------------------------------------------ TPU platform


def _pci(root: Path, devices: dict) -> Path:
    """A fake ``/sys/bus/pci/devices``: {slot: (vendor, device)}."""
    for slot, (vendor, device) in devices.items():
        (root / slot).mkdir(parents=True)
        (root / slot / "vendor").write_text(vendor + "\n")
        (root / slot / "device").write_text(device + "\n")
    return root


def test_tpu_attached_reads_the_pci_bus(tmp_path):
    gvnic = {"0000:00:04.0": ("0x1ae0", "0x0042")}  # Google's virtual NIC, not a TPU
    nvidia = {"0000:00:05.0": ("0x10de", "0x2330")}
    assert not jaxcompat.tpu_attached(str(_pci(tmp_path / "a", {**gvnic, **nvidia})))
    assert not jaxcompat.tpu_attached(str(tmp_path / "missing"))
    v5e = {"0000:00:06.0": ("0x1ae0", "0x0063")}
    assert jaxcompat.tpu_attached(str(_pci(tmp_path / "b", {**gvnic, **v5e})))
    tpu7x = {"0000:00:07.0": ("0x1ae0", "0x0076")}
    assert jaxcompat.tpu_attached(str(_pci(tmp_path / "c", tpu7x)))


@needs_libtpu
def test_skip_absent_tpu_keeps_what_the_user_set_and_hosts_with_a_tpu(tmp_path):
    no_tpu = str(_pci(tmp_path / "cpu", {"0000:00:04.0": ("0x1ae0", "0x0042")}))
    environ = {}
    added = jaxcompat.skip_absent_tpu(environ, pci_root=no_tpu)
    assert added == environ
    assert "tpu" not in environ["JAX_PLATFORMS"].split(",")
    assert environ["JAX_PLATFORMS"].split(",")[-1] == "cpu"
    assert environ["TPU_WORKER_HOSTNAMES"] == "localhost"
    environ = {"JAX_PLATFORMS": "", "TPU_HOST_BOUNDS": "2,2,1"}
    assert jaxcompat.skip_absent_tpu(environ, pci_root=no_tpu) == {
        "TPU_WORKER_HOSTNAMES": "localhost"}
    assert environ["JAX_PLATFORMS"] == "" and environ["TPU_HOST_BOUNDS"] == "2,2,1"
    tpu = str(_pci(tmp_path / "tpu", {"0000:00:05.0": ("0x1ae0", "0x006f")}))
    environ = {}
    assert jaxcompat.skip_absent_tpu(environ, pci_root=tpu) == {} and environ == {}
    assert jaxcompat.libtpu_single_host(environ, pci_root=tpu) == {} and environ == {}


def test_cuda_plugin_without_gpu_skips_the_runtime_check_only_without_a_gpu(tmp_path):
    absent = (str(tmp_path / "nvidia0"),)
    environ = {}
    assert jaxcompat.cuda_plugin_without_gpu(environ, device_files=absent) == {
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"} == environ
    environ = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": ""}
    assert jaxcompat.cuda_plugin_without_gpu(environ, device_files=absent) == {}
    assert environ == {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": ""}
    (tmp_path / "nvidia0").write_text("")
    environ = {}
    assert jaxcompat.cuda_plugin_without_gpu(environ, device_files=absent) == {} == environ


def _clean_env() -> dict:
    """This process's environment without the settings that decide jax's platforms and
    libtpu's start (as a new user's shell has it), and with libtpu free to start although
    another process (a parallel test worker) holds its lock file, as on a user's idle host
    (where it otherwise starts and prints its errors)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME", "XLA_FLAGS")
           and not k.startswith("TPU_")}
    env["PYTHONPATH"] = str(ROOT)
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    return env


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(n in line for n in LIBTPU_NOISE)]


@needs_libtpu
@no_tpu_here
def test_devices_on_a_cpu_host_prints_no_libtpu_errors():
    """`gdngen devices` with libtpu installed and no TPU: jax runs on the CPU and stderr has
    none of libtpu's start-up errors (jax's TPU platform is not started)."""
    proc = subprocess.run([sys.executable, "-m", "gdngen", "devices", "--json"],
                          capture_output=True, text=True, cwd=ROOT, env=_clean_env(),
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _noise(proc.stderr) == [], proc.stderr[-2000:]
    assert json.loads(proc.stdout)["detected"]["jax"]["name"] == "cpu"


@needs_libtpu
@no_tpu_here
def test_compile_for_a_topology_on_a_cpu_host_prints_no_libtpu_errors(tmp_path):
    """`gdngen build --compile` for tpu-v5e: libtpu starts for the compile-only topology, with
    its single-host settings, so quietly; the compile is Mosaic's as without them."""
    variant = ('{"chunk_size": 64, "dv_tile": 128, "head_tile": 2, "precision": "ieee", '
               '"save_states": true, "recurrent_below": 64}')
    proc = subprocess.run(
        [sys.executable, "-m", "gdngen", "build", "--backend", "pallas_tpu", "--problem",
         "Hk=1,Hv=2,Dk=128,Dv=128,dtype=bfloat16", "--device", "tpu-v5e", "--compile",
         "--compile-seq", "64", "--no-validate", "--variant", variant,
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=ROOT, env=_clean_env(), check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _noise(proc.stderr) == [], proc.stderr[-2000:]
    entry = json.loads((tmp_path / "out" / "manifest.json").read_text())["variants"][0]
    assert entry["compile"]["ok"] is True and entry["compile"]["target"] == "TPU v5 lite"
    assert entry["compile"]["vmem_used"] > 0


@needs_libtpu
@no_tpu_here
@pytest.mark.parametrize("order", ["jax_first", "gdngen_first", "package_only"])
def test_a_script_importing_gdngen_jax_prints_no_libtpu_errors(order):
    """A library user's script (no gdngen command, no settings of its own): with libtpu
    installed and no TPU, its first jit prints libtpu's start-up errors without gdngen, and
    none once it imports ``gdngen.jax``, before or after jax, or only the package (`import
    gdngen`, as an MLX user's or a benchmark's script does: `jaxcompat.quiet_host`)."""
    jit = "print(jax.jit(lambda x: x + 1)(jnp.ones(2)))"
    scripts = {"plain": f"import jax, jax.numpy as jnp; {jit}",
               "jax_first": f"import jax, jax.numpy as jnp; import gdngen.jax; {jit}",
               "gdngen_first": f"import gdngen.jax; import jax, jax.numpy as jnp; {jit}",
               "package_only": f"import gdngen; import jax, jax.numpy as jnp; {jit}"}
    runs = {name: subprocess.run([sys.executable, "-c", scripts[name]], capture_output=True,
                                 text=True, cwd=ROOT, env=_clean_env(), check=False)
            for name in ("plain", order)}
    for proc in runs.values():
        assert proc.returncode == 0 and proc.stdout.strip() == "[2. 2.]", proc.stderr[-2000:]
    assert _noise(runs["plain"].stderr), "libtpu started quietly without gdngen: nothing to show"
    assert _noise(runs[order].stderr) == [], runs[order].stderr[-2000:]


def test_quiet_host_keeps_what_the_user_set(monkeypatch):
    """After jax is imported, `quiet_host` sets jax's ``jax_platforms`` (to `skip_absent_tpu`'s
    choice) only where neither the environment nor jax's option names the platforms and jax
    has started none."""
    import jax
    from jax._src import xla_bridge

    before = jax.config.jax_platforms
    started = {"yes": True}
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: started["yes"])
    environ = {}
    assert "jax_platforms" not in jaxcompat.quiet_host(environ)
    assert "JAX_PLATFORMS" not in environ and jax.config.jax_platforms == before
    started["yes"] = False
    assert "jax_platforms" not in jaxcompat.quiet_host({"JAX_PLATFORMS": ""})
    assert jax.config.jax_platforms == before
    if before is not None:
        return
    expected = jaxcompat.skip_absent_tpu({}).get("JAX_PLATFORMS")
    try:
        added = jaxcompat.quiet_host({})
        assert added.get("jax_platforms") == expected
        assert jax.config.jax_platforms == expected
    finally:
        jax.config.update("jax_platforms", before)


def test_a_libtpu_release_refused_for_a_topology_says_why(monkeypatch):
    """TPU7x with libtpu 0.0.48 (jax 0.11): the topology builds, but its Mosaic's backward
    exceeds the footprint model's margin, so `tpu_topology_missing` refuses it with why;
    0.0.42 (jax 0.10) and 0.0.50 (jax 0.12) are used."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(jaxcompat, "get_topology_desc", lambda **kw: object())
    for version, refused in (("0.0.42.1", False), ("0.0.48.1", True), ("0.0.49", True),
                             ("0.0.50.1", False)):
        monkeypatch.setattr(jaxcompat, "_distribution_version", lambda name, v=version: v)
        jaxcompat.tpu_topology_missing.cache_clear()
        reason = jaxcompat.tpu_topology_missing("tpu7x:2x2x1")
        assert (reason is not None) == refused, (version, reason)
        if refused:
            assert f"libtpu {version} knows the topology 'tpu7x:2x2x1'" in reason
            assert "1.47x the VMEM" in reason
        assert jaxcompat.tpu_topology_missing("v5e:2x2") is None
    jaxcompat.tpu_topology_missing.cache_clear()
