"""The ``xp`` array namespaces the algebra is written against: `ArrayNamespace` is their base;
each framework's (`gdngen.backends.portable.jax_chunkwise.XP`,
`gdngen.backends.portable.mlx_chunkwise.XP`) sets ``module`` and adds ``cumsum``, ``cumprod``,
``tril_mask`` and ``scan`` (lax.scan semantics)."""

from __future__ import annotations

import functools


class ArrayNamespace:
    """Base of the ``xp`` namespaces: subclasses set ``module`` (jax.numpy, mlx.core) and add
    ``cumsum``, ``cumprod``, ``tril_mask`` and ``scan``; the rest maps onto the module's own
    functions."""

    module = None
    _SAME_NAME = ("exp", "log", "where", "concatenate", "stack", "swapaxes", "einsum")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls._SAME_NAME:
            setattr(cls, name, staticmethod(getattr(cls.module, name)))

    @classmethod
    def repeat(cls, x, n, axis):
        return cls.module.repeat(x, n, axis=axis)

    @classmethod
    def pad_time(cls, x, pad, value):
        """Pad axis 1 (time) of ``x`` at the end with ``pad`` entries of ``value``."""
        return cls.module.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2),
                              constant_values=value)

    @classmethod
    def rsqrt(cls, x):
        return 1.0 / cls.module.sqrt(x)

    @classmethod
    def sigmoid(cls, x):
        return 1.0 / (1.0 + cls.module.exp(-x))

    @classmethod
    def softplus(cls, x):
        """``log(1 + exp(x))`` as ``logaddexp(x, 0)``: x for large x, exp(x) for very negative
        x; its derivative is sigmoid(x)."""
        return cls.module.logaddexp(x, 0.0)

    @staticmethod
    def barrier(arrays):
        """``arrays`` (a tuple) through a point the compiler may not merge computations across
        (a recomputation in a backward stays there, not fused with the forward's)."""
        return arrays

    @staticmethod
    def mul_sum(a, b, axis):
        """``(a * b).sum(axis)`` with numpy broadcasting."""
        return (a * b).sum(axis=axis)

    @staticmethod
    def dot_last(a, b):
        """``(a * b).sum(-1)`` with numpy broadcasting: the recurrent step's state-vector
        products (`recurrent_forward`)."""
        return (a * b).sum(axis=-1)

    @classmethod
    def compiled(cls, step):
        """``step(xp, *arrays)`` bound to this namespace, as the framework best runs an eagerly
        called small function (`recurrent_step`); here as it is (JAX traces it anyway)."""
        return functools.partial(step, cls)

    @classmethod
    def scatter_add(cls, n, index, values):
        """``[n, ...]`` zeros plus ``values [m, ...]`` added at rows ``index [m]`` (repeats
        add up)."""
        return cls.zeros((n,) + tuple(values.shape[1:])).at[index].add(values)

    @classmethod
    def zeros(cls, shape):
        return cls.module.zeros(shape, cls.module.float32)

    @classmethod
    def eye(cls, n):
        return cls.module.eye(n, dtype=cls.module.float32)
