"""The patch table: every change dynamo_ext makes to torch's modules, in one place.

Applied and undone as one unit by ``dynamo_ext.enable()`` / ``disable()``
(``_patches.PatchSet``).  Hooks that only live while a trace runs (attribute hooks
on subclass classes, run-eagerly marks on refused dispatch code) go through the
handles in ``_patches`` (``CLASS_HOOKS``, ``CODE_MARKS``), which ``disable()`` also
undoes.  Targets are the module globals and class attributes torch resolves at call
time, so a name bound before ``enable()`` (``from functorch.compile import
aot_function``) still goes through them.
"""

from __future__ import annotations

from typing import Any

from . import _compat, aot_cache, aot_layer, capture, dtensor, dynamo_layer, writeback, zero_sign
from ._patches import Patch

_PROPERTY_WHY = (
    "x.data, x.T, x.mT (...) run dispatch; Dynamo gives the result a source it evaluates on the "
    "real input (a method lookup, guards, residual bytecode), running dispatch there. For a "
    "subclass that may write state the result is made with no source (See Note [A tensor "
    "property on a subclass])"
)

_REWRITTEN_METHODS = ("addcmul_", "addcdiv_", "add_")
_METHOD_REWRITE_WHY = (
    "Dynamo puts mul/div, fma and copy_ in the graph for x.addcmul_/addcdiv_(..., value=v) and "
    "x.add_(y, alpha=tensor); eager hands dispatch the in-place op: with a subclass that may "
    "write state as the tensor or an argument the rewrite is passed by (See Note [Torch "
    "functions Dynamo rewrites])."
)

def _backward_error_hook(original: Any) -> Any:
    """``MetaConverter._backward_error``: capture's, around dtensor's from torch 2.14."""
    if _compat.applies(((2, 14), (2, 15))):
        original = dtensor.make_backward_error_hook(original)
    return capture.make_backward_error_hook(original)


#: Every change dynamo_ext makes to torch.
TABLE: list[Patch] = [
    Patch(
        "torch._dynamo.utils",
        "_get_fake_value_impl",
        dynamo_layer.make_fake_value_hook,
        why="Dynamo runs __torch_dispatch__ on fake example values here; reads are answered "
        "from the real objects and guarded, writes recorded with SideEffects. Callers import "
        "get_fake_value by name, so the module-global impl it calls is the one place that "
        "sees every op.",
    ),
    Patch(
        "torch._dynamo.output_graph:OutputGraph",
        "compile_subgraph",
        dynamo_layer.make_compile_subgraph_hook,
        why="Restore the traced objects before codegen, guards and the backend see them, and "
        "hand what the Dynamo layer recorded to the AOTAutograd layer.",
    ),
    Patch(
        "torch._dynamo.output_graph:OutputGraph",
        "handle_aliases_for_stolen_lists",
        dynamo_layer.make_stolen_lists_hook,
        why="A value user code read before dispatch wrote its attribute is loaded before the "
        "graph runs, not from the attribute after it (See Note [Values read before dispatch "
        "wrote them]); compile_subgraph takes its pre-graph instructions and source overrides "
        "from here.",
    ),
    Patch(
        "torch._dynamo.variables.tensor:TensorVariable",
        "unpack_var_sequence",
        dynamo_layer.make_unpack_hook,
        why="Dynamo unrolls iteration over a tensor into one indexing op per row; eager's "
        "Tensor.__iter__ hands dispatch one unbind(0): a subclass that may write state is "
        "iterated as eager iterates it (See Note [Iterating a subclass tensor]).",
    ),
    Patch(
        "torch._dynamo.variables.tensor:TensorVariable",
        "var_getattr",
        dynamo_layer.make_var_getattr_hook,
        why=_PROPERTY_WHY + ".",
        versions=((2, 13), (2, 13)),
    ),
    Patch(
        "torch._dynamo.variables.tensor:TensorVariable",
        "tp_getattro_impl",
        dynamo_layer.make_var_getattr_hook,
        why=_PROPERTY_WHY + " (TensorVariable.var_getattr's successor).",
        versions=((2, 14), (2, 15)),
    ),
    Patch(
        "torch._dynamo.variables.higher_order_ops:AutogradFunctionApplyVariable",
        "trace_backward_graph",
        dynamo_layer.make_backward_code_hook,
        why="Dynamo traces an autograd.Function's backward with the forward: a read there of "
        "state dispatch may write is refused, eager reads it when backward() runs (See Note "
        "[Backward code Dynamo traces with the forward]).",
    ),
    Patch(
        "torch._dynamo.side_effects:SideEffects",
        "load_attr",
        dynamo_layer.make_load_attr_hook,
        why="A name the traced code wrote is read back from Dynamo's pending writes: in backward "
        "code Dynamo traces with the forward, a read of state dispatch may write is refused as "
        "through var_getattr (See Note [Backward code Dynamo traces with the forward]).",
    ),
    Patch(
        "torch._dynamo.variables.tensor:TensorVariable",
        "_method_register_hook",
        dynamo_layer.make_backward_code_hook,
        why="Dynamo traces a hook on an intermediate with the forward: a read there of state "
        "dispatch may write is refused, eager reads it when backward() runs (See Note "
        "[Backward code Dynamo traces with the forward]).",
    ),
    Patch(
        "torch._dynamo.variables.torch:TorchInGraphFunctionVariable",
        "_get_handlers",
        dynamo_layer.make_handlers_hook,
        why="Dynamo rewrites some torch functions into other ops (torch.addcdiv with value=, "
        "torch.full with a tensor fill, _foreach_lerp_, _foreach_pow, tensor_split); eager hands "
        "dispatch the function's own op: with a subclass that may write state among the "
        "arguments the rewrite is passed by (See Note [Torch functions Dynamo rewrites]).",
    ),
    Patch(
        "torch._dynamo.variables.builder",
        "handle_traced_output",
        dynamo_layer.make_traced_output_hook,
        why="A tag dispatch puts on the plain tensor an op returns (out.scale = 0.5) is on the "
        "traced result's FakeTensor, not on Dynamo's variable: a constant tag is recorded as a "
        "pending write on the variable, so code later in the frame reads it as eager does (See "
        "Note [A tag dispatch puts on an op's plain result]).",
    ),
    Patch(
        "torch._dynamo.variables.builder",
        "_wrap_fx_preexisting_tensor",
        dynamo_layer.make_preexisting_tensor_hook,
        why="The items of an op's tuple result (torch.split, unbind) get variables Dynamo does not "
        "track for attribute writes: a subclass item whose class may write is tracked as any "
        "tensor the graph computed, so what dispatch writes on it is recorded (See Note [A "
        "subclass value Dynamo does not track]). torch 2.15 tracks them itself.",
        versions=((2, 13), (2, 14)),
    ),
    *(
        Patch(
            "torch._dynamo.variables.tensor:TensorVariable",
            f"method_{name}",
            dynamo_layer.make_method_rewrite_hook,
            why=_METHOD_REWRITE_WHY,
            versions=((2, 13), (2, 13)),
        )
        for name in _REWRITTEN_METHODS
    ),
    *(
        Patch(
            f"torch._dynamo.variables.tensor:TensorVariable.tp_methods[{name}]",
            "handler",
            dynamo_layer.make_method_rewrite_hook,
            why=_METHOD_REWRITE_WHY[:-1] + " (from torch 2.14 an entry of TensorVariable's tp_methods "
            "table holds the handler, called from there).",
            versions=((2, 14), (2, 15)),
        )
        for name in _REWRITTEN_METHODS
    ),
    Patch(
        "torch._subclasses.meta_utils:MetaConverter",
        "_backward_error",
        _backward_error_hook,
        why="Faking a non-leaf subclass that requires grad (a graph-break resume's input, an "
        "AOTAutograd input) fakes its autograd history through its dispatch (detach), outside any "
        "trace: a write there on a registered state object its ctx holds, the real one, is put "
        "back, and the copy keeps the inner tensors the input's fake holds (See Note [A fake copy's "
        "inner tensors] in capture.py). From torch 2.14 also See Note [A pending DTensor mask in a fake copy]: the fake "
        "copy of a partial DTensor that requires grad would apply the caller's real mask to a fake.",
    ),
    Patch(
        "torch._dynamo.convert_frame",
        "_compile",
        dynamo_layer.make_frame_compile_hook,
        why="A dynamo_ext refusal inside the body of a higher-order op that allows no graph break "
        "(nested_compile_region) becomes UncapturedHigherOrderOpError, raised under "
        "fullgraph=False too: there the frame runs eagerly instead (See Note [A refusal inside a "
        "higher-order op's body]); so too where torch 2.13 fails to recompile a frame whose input "
        "holds a subclass gradient (See Note [A recompile torch 2.13 fails on a subclass gradient]).",
    ),
    Patch(
        "torch._dynamo.convert_frame",
        "maybe_disable_inference_mode",
        dynamo_layer.make_inference_mode_hook,
        why="Spans one frame's compile. Dynamo turns inference mode off while it compiles; "
        "dispatch reading torch.is_inference_mode_enabled() would be answered False where eager "
        "reads the caller's mode (See Note [Inference mode while traced]): the caller's mode is "
        "noted here. The class-level state of the subclasses the compile fakes is put back when "
        "it ends (See Note [Constructors torch runs while compiling]).",
        defined_here=False,  # defined in torch._dynamo.utils, called through convert_frame's binding
    ),
    Patch(
        "torch._dynamo.variables.builder:VariableBuilder",
        "wrap_tensor",
        dynamo_layer.make_wrap_tensor_hook,
        why="Dynamo reads a real input's properties while it compiles, each through the class's "
        "__torch_function__: the instance dict of an input whose class has its own is taken before "
        "the first read and put back when the compile ends (See Note [Torch functions torch runs on "
        "a real input while compiling] in free_state.py).",
    ),
    Patch(
        "torch._dynamo.variables.builder",
        "_wrap_to_fake_tensor_and_record_impl",
        dynamo_layer.make_fakify_hook,
        why="Dynamo fakes a subclass input through its __tensor_unflatten__, running its "
        "constructor: the class-level state it may count in is noted first, and put back when "
        "the compile ends (See Note [Constructors torch runs while compiling]).",
    ),
    Patch(
        "torch._dynamo.guards",
        "deepcopy",
        dynamo_layer.make_guard_deepcopy,
        why="Guards deep-copy subclass ctx (DTensor specs) to compare later calls with it; "
        "objects registered with register_ctx_state are shared state compared by identity "
        "(_MaskPartial.__eq__), so the copy must keep them or the guard never holds.",
        defined_here=False,  # copy.deepcopy, as guards.py binds it
    ),
    Patch(
        "torch._dynamo.guards:GuardBuilder",
        "TENSOR_SUBCLASS_METADATA_MATCH",
        dynamo_layer.make_metadata_guard_hook,
        why="A counter in a subclass's flatten ctx that became a symbolic input must not be "
        "specialized again by the ctx guard (See Note [Symbolic ints in a flatten ctx]).",
    ),
    Patch(
        "torch._dynamo.guards:GuardBuilder",
        "EQUALS_MATCH",
        zero_sign.make_equals_guard_hook,
        why="A float zero's sign is guarded beside ==, which does not tell -0.0 from 0.0 "
        "(See Note [The sign of a float zero]); torch 2.15 compares the bits itself.",
        versions=((2, 13), (2, 14)),
    ),
    Patch(
        "torch._dynamo.variables.builder:VariableBuilder",
        "wrap_symfloat",
        zero_sign.make_wrap_symfloat_hook,
        why="An unspecialized float zero becomes a sympy zero, which has no sign: float zeros "
        "are specialized (See Note [The sign of a float zero]).",
    ),
    Patch(
        "torch._functorch.aot_autograd",
        "prepare_aot_module_simplified",
        aot_layer.make_prepare_hook,
        why="Wrap the function AOTAutograd traces for aot_module_simplified (every "
        "AOTAutograd-based Dynamo backend): each tracing pass runs in a capture scope and "
        "returns new tensor attributes as extra outputs. Called as a module global.",
    ),
    Patch(
        "torch._functorch.aot_autograd",
        "create_tree_flattened_fn",
        aot_layer.make_tree_flattened_fn_hook,
        why="The same for aot_function (and aot_module, functorch's compilers), which builds "
        "its traced function here at its first call; imported into aot_autograd's namespace "
        "and called from there.",
        defined_here=False,  # imported into aot_autograd, called from there
    ),
    Patch(
        "torch._functorch.aot_autograd",
        "create_aot_state",
        aot_layer.make_create_aot_state_hook,
        why="AOTAutograd refuses outputs aliasing one another once subclass inputs are "
        "involved; where the written tensors the plan returns alias one another (a view kept "
        "beside its base), that is turned into a dynamo_ext refusal, which runs the frame "
        "eagerly under fullgraph=False (See Note [Written tensors that alias one another]).",
    ),
    Patch(
        "torch._functorch.aot_autograd",
        "aot_stage2_compile",
        aot_layer.make_stage2_hook,
        why="The compiled callable of every AOTAutograd entry point comes out of stage 2: "
        "it gets the run-time replay of the frozen write plan.",
        defined_here=False,  # imported into aot_autograd, called from there
    ),
    Patch(
        "torch._functorch._aot_autograd.graph_capture",
        "create_joint",
        aot_layer.make_create_joint_hook,
        why="The joint function traces the forward (a tracing pass) then the backward: the "
        "backward's reads and writes on the pass's instances are recorded while it runs "
        "(counters it bumps are replayed at every backward). Imported there by name.",
        defined_here=False,
    ),
    Patch(
        "torch._functorch._aot_autograd.autograd_cache:AOTAutogradCache",
        "try_load",
        aot_cache.make_try_load_hook,
        why="A cache hit skips every tracing pass: a graph with subclass inputs is looked up "
        "under a key that covers the Dynamo layer's hand-off, and a hit guards the state "
        "its plan was traced from and replays the plan (See Note [A cache entry holds its "
        "plan]).",
    ),
    Patch(
        "torch._functorch._aot_autograd.autograd_cache",
        "autograd_cache_key",
        aot_cache.make_cache_key_hook,
        why="The key of a graph with subclass inputs also covers which writes Dynamo's "
        "residual bytecode replays. try_load calls it as a module global.",
    ),
    Patch(
        "torch._functorch._aot_autograd.autograd_cache:AOTAutogradCache",
        "_lookup",
        aot_cache.make_lookup_hook,
        why="An entry is used only where the real inputs hold the state its plan was traced "
        "from; otherwise the lookup is a miss.",
    ),
    Patch(
        "torch._functorch._aot_autograd.autograd_cache:AOTAutogradCache",
        "save",
        aot_cache.make_save_hook,
        why="The entry of a graph with subclass inputs is saved with its frozen plan (stage 2 "
        "saves before the plan is frozen, or at the first backward), or not at all.",
    ),
    Patch(
        "torch.export._trace",
        "create_functional_call",
        aot_layer.make_export_functional_call_hook,
        why="Non-strict torch.export traces through it (imported by name) with no run-time "
        "epilogue: writes made there are refused instead of silently dropped.",
        defined_here=False,
    ),
    Patch(
        "torch._functorch._aot_autograd.collect_metadata_analysis",
        "coerce_tangent_and_suggest_memory_format",
        aot_layer.make_coerce_tangent_hook,
        why="Tangent coercion runs on a pass's outputs after the pass undid its ctx-state "
        "writes; DTensor needs the mask to coerce a _MaskPartial output, so it sees the "
        "state the pass left, undone again after. Called as a module global.",
    ),
    Patch(
        "torch._functorch._aot_autograd.runtime_wrappers:AOTDispatchAutograd",
        "process_runtime_tangent",
        aot_layer.make_process_tangent_hook,
        why="The compiled backward coerces an incoming gradient whose flatten ctx differs from "
        "the traced one (__coerce_same_metadata_as_tangent__); a coercion that changes a value "
        "the traced backward read is refused there (See Note [A gradient coerced to the traced "
        "metadata]). A staticmethod the generated prologue binds when it is built.",
        runtime=True,
    ),
    Patch(
        "torch._functorch._aot_autograd.graph_capture_wrappers",
        "apply_in_graph_mutations",
        writeback.make_apply_in_graph_mutations,
        why="Data mutations of subclass inputs kept in the graph are written back with the "
        "subclass's own copy_, which DTensor cannot dispatch for a _MaskPartial input (the "
        "reduction masks the pending local shard in place); fall back to copying the inner "
        "tensors when old and new have the same flatten ctx. Called as a module global.",
    ),
    Patch(
        "torch._functorch._aot_autograd.subclass_codegen",
        "_compile_and_exec_source",
        writeback.make_compile_and_exec_source,
        why="The same for the run-time mutation epilogue AOTAutograd generates "
        "(_apply_mutations): its copy_ calls go through the same fallback. Imported by "
        "name inside the functions that call it, so the module global is the one to wrap.",
        versions=((2, 13), (2, 13)),
    ),
    Patch(
        "torch._functorch._aot_autograd.codegen",
        "_compile_and_exec_source",
        writeback.make_compile_and_exec_source,
        why="From torch 2.14 the run-time epilogues are built by codegen.PySourceBuilder, "
        "which compiles them here (subclass_codegen only re-exports the name).",
        versions=((2, 14), (2, 15)),
    ),
]
