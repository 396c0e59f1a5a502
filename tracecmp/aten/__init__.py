"""What tracecmp knows about aten (and custom) operators, shared by capture, replay and judging.

* :mod:`tracecmp.aten.schema`: per-operator facts from the schema's alias annotations (what an
  op writes, which returns are views, whether it draws random numbers), operator lookup by name,
  and a call's outputs in capture's order.
* :mod:`tracecmp.aten.args`: a call's non-tensor arguments as JSON text and back.
* :mod:`tracecmp.aten.opclass`: how an op carries its inputs' error to its outputs.
* :mod:`tracecmp.aten.overflow`: the overflow record, an op whose finite inputs produced NaN/Inf.

Nothing here imports capture or comparison: both import this.
"""
