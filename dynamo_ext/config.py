"""Switches of dynamo_ext (module attributes, read at trace time)."""

#: Record dispatch writes in Dynamo (the primary path).
dynamo_layer: bool = True

#: Restore AOTAutograd's traced instances after each tracing pass and hand them the
#: constant state of the real inputs.
aot_layer: bool = True
