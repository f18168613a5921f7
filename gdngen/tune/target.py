"""What one study tunes (`Target`), which targets a device has, and which are worth a study.

`skip_reason` names targets not worth a study (the command skips them): those whose execution
ignores the variant (a gate kind outside the backend's ``tuned_gates``: the generated backends run
per-channel gates through their recurrent kernel and the portable chunk path's gradient) or whose
space has a single variant.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdngen import cache
from gdngen.problem import Problem
from gdngen.registry import default_variant, variants
from gdngen.variant import Variant


def _precision_allowed(variant: Variant, policy: str) -> bool:
    """A variant's own ``precision`` param may be as accurate as ``policy`` or more."""
    from gdngen.precision import rank

    own = variant.get("precision")
    return own is None or rank(own) <= rank(policy)


@dataclass(frozen=True)
class Target:
    """What one study tunes: ``backend`` on ``device`` through ``framework`` for ``problem`` at
    sequence length ``seq_len`` and batch ``batch`` under a precision policy."""

    device: str
    framework: str
    backend: str
    problem: Problem
    precision: str = "ieee"
    seq_len: int = 2048
    batch: int = 1
    #: variant names left out of the space (those that do not compile for the device:
    #: `gdngen.compilers.check_targets`)
    excluded: tuple = ()

    def default(self) -> Variant:
        """The backend's default variant on the device (its own precision param, if any,
        raised to the policy when the default is less accurate)."""
        variant = default_variant(self.backend, self.problem, self.device)
        if not _precision_allowed(variant, self.precision):
            variant = variant.replace(precision=self.precision)
        return variant

    def space(self) -> list[Variant]:
        """The backend's variants that fit the device, are not `excluded` and whose own
        precision param (if any) is at least as accurate as the target's policy."""
        return [v for v in variants(self.backend, self.problem, self.device)
                if _precision_allowed(v, self.precision) and v.name() not in self.excluded]

    def label(self) -> str:
        return (f"{self.framework}/{self.backend} {self.problem.key()} {self.precision} "
                f"B={self.batch} T={self.seq_len}")


def study_name(target: Target) -> str:
    """Study name: the target, the gdngen version and the default variant's render sha256
    prefix, so that a code change starts a fresh study instead of mixing old timings in."""
    from gdngen._version import __version__

    sha = cache.variant_sha256(target.default(), target.problem)
    return (f"gdngen-{__version__}:{target.device}:{target.backend}:{target.problem.key()}:"
            f"{target.precision}:B{target.batch}:T{target.seq_len}:{sha[:12]}")


def targets(device: str, frameworks, problems, *, precision: str = "ieee", seq_lens=(2048,),
            batch: int = 1, backends=None) -> list[Target]:
    """Every (framework, backend, problem, T) the device can tune: backends of the framework
    targeting the device, implementing the problem and runnable here (`gdngen.registry
    .runnable`), and (if given) in ``backends``."""
    from gdngen.devices import get_device
    from gdngen.precision import check_precision
    from gdngen.registry import runnable

    get_device(device)
    out = []
    for framework in frameworks:
        check_precision(framework, precision)
        for problem in problems:
            for backend in runnable(framework, problem, device):
                if backends and backend not in backends:
                    continue
                out.extend(Target(device, framework, backend, problem, precision, int(t), batch)
                           for t in seq_lens)
    return out


def tolerance_for(target: Target, variant: Variant) -> float:
    """Validation tolerance of ``variant`` in ``target``: `gdngen.tolerance.allowed_error` at
    the problem's dtype under the target's policy (the rule ``gdngen build`` uses too)."""
    from gdngen.tolerance import allowed_error

    return allowed_error(variant, target.problem.dtype, target.precision)


def skip_reason(target: Target) -> str | None:
    """Why tuning ``target`` would be pointless (nothing to choose between), or None: a gate
    kind outside the backend's ``tuned_gates`` runs a path without tunables (the generated
    backends' per-channel gates), or the space has a single variant."""
    from gdngen.registry import get

    if target.problem.gate not in get(target.backend).tuned_gates:
        return (f"{target.backend} runs {target.problem.gate} gates through its recurrent "
                "kernel and the portable chunk path's gradient, which have no tunables")
    if len(target.space()) < 2:
        return f"{target.backend} has a single variant for {target.problem.key()}"
    return None


def default_frameworks(device: str) -> tuple[str, ...]:
    """Frameworks tuned when none is named: MLX on Apple GPUs, JAX on TPUs/NVIDIA GPUs, every
    installed one on the CPU."""
    from gdngen.devices import get_device, installed_frameworks

    kind = get_device(device).kind
    wanted = {"apple": ("mlx",), "tpu": ("jax",), "gpu": ("jax",)}.get(kind, ("jax", "mlx"))
    return tuple(fw for fw in wanted if fw in installed_frameworks())
