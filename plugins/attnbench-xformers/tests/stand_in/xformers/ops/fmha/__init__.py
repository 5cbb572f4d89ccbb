"""Stand-in for ``xformers.ops.fmha`` (see the package docstring)."""

from xformers.ops.fmha import attn_bias, triton_splitk  # noqa: F401
