"""Switches of dynamo_ext (module attributes, read at trace time)."""

#: Record dispatch writes in Dynamo's SideEffects (the primary path). When False,
#: Dynamo's fake example values are still kept consistent and restored, and the
#: AOTAutograd layer alone plans and replays the writes (backends built on
#: AOTAutograd; with backend="eager" dispatch runs for real at run time anyway).
dynamo_layer: bool = True

#: Catch, unwind and replay writes in AOTAutograd's tracing passes.
aot_layer: bool = True
