"""Stand-in for ``xformers.ops.fmha.triton_splitk`` (see the package docstring): operator markers only."""


class FwOp:
    IS_STAND_IN_OP = True
    SPLIT_K: int | None = None


class FwOp_S2(FwOp):
    SPLIT_K = 2


class FwOp_S4(FwOp):
    SPLIT_K = 4


class FwOp_S8(FwOp):
    SPLIT_K = 8


class FwOp_S16(FwOp):
    SPLIT_K = 16


class FwOp_S32(FwOp):
    SPLIT_K = 32
