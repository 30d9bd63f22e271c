"""The op interface (DLInfer-style): the model calls named ops; each op has a reference
implementation in plain torch (any device) and a device-specific one may replace it.

    ops = get_ops(torch.device("cpu"))   # resolved once per engine, not per call
    y = ops.rms_norm(x, w, eps)
"""
from dlbatch.engine.ops.registry import OP_NAMES, register_op
from dlbatch.engine.ops.resolve import Ops, get_ops

__all__ = ["OP_NAMES", "Ops", "get_ops", "register_op"]
