"""Model presets: the linear-attention head layouts of real GatedDeltaNet-style models.

One table, `PRESETS`; each entry names where its numbers come from. ``Preset.problem(dtype)``
gives the `gdngen.Problem` to tune for.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdngen.problem import Problem


@dataclass(frozen=True)
class Preset:
    """Head layout of one model's gated-delta layers: key heads Hk, value heads Hv, head dims,
    gate kind ("scalar": one decay per head and step; "vector": one per key channel)."""

    name: str
    Hk: int
    Hv: int
    Dk: int
    Dv: int
    gate: str
    source: str

    def problem(self, dtype: str = "float32") -> Problem:
        return Problem(self.Hk, self.Hv, self.Dk, self.Dv, dtype, self.gate)


PRESETS: dict[str, Preset] = {
    p.name: p for p in (
        # config.json of Qwen/Qwen3-Next-80B-A3B-*: linear_num_key_heads=16,
        # linear_num_value_heads=32, linear_key_head_dim=linear_value_head_dim=128 (the same
        # fields mlx_lm.models.qwen3_next.ModelArgs reads).
        Preset("qwen3-next", 16, 32, 128, 128, "scalar",
               "Qwen3-Next-80B-A3B config.json (linear_* fields)"),
        # mlx_lm 0.32 mlx_lm/models/qwen3_5.py TextModelArgs defaults: linear_num_key_heads=16,
        # linear_num_value_heads=64, linear_key_head_dim=192, linear_value_head_dim=128.
        Preset("qwen3.5", 16, 64, 192, 128, "scalar",
               "mlx_lm 0.32 qwen3_5.TextModelArgs defaults"),
        # Kimi Linear (Kimi-Linear-48B-A3B) KDA layers: linear_attn_config num_heads=32,
        # head_dim=128 for q, k and v (mlx_lm/models/kimi_linear.py), and a per-channel gate
        # ([B,T,H,head_dim] a_logits), i.e. a vector gate.
        Preset("kimi-linear", 32, 32, 128, 128, "vector",
               "Kimi-Linear-48B-A3B linear_attn_config; mlx_lm kimi_linear.py"),
    )
}


def get_preset(name: str) -> Preset:
    """The preset ``name``; ValueError listing the known names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"model must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
