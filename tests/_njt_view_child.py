"""Child process of test_njt.py: compile ``x.sin()`` on a view of a jagged NestedTensor.

torch caches an NJT's sizes on its Python object (``_sym_sizes_capsule`` and its length);
answering or copying those as subclass state aborts the process, hence a child process.
Prints the outcome as the last line.
"""

import sys

import torch

import dynamo_ext


def make(base_is_nt: bool, base_requires_grad: bool, view_requires_grad: bool) -> torch.Tensor:
    parts = [torch.randn(2, 3), torch.randn(3, 3), torch.randn(4, 3)]
    x = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=base_requires_grad)
    x = x.clone() if base_is_nt else x
    with torch.no_grad():
        view = x.unsqueeze(-1)
        view.requires_grad_(view_requires_grad)
    return view


def main() -> None:
    backend = sys.argv[1]
    flags = [a == "1" for a in sys.argv[2:5]]
    dynamo_ext.enable()
    torch.manual_seed(0)
    expected = make(*flags).sin()
    torch.manual_seed(0)
    out = torch.compile(lambda t: t.sin(), backend=backend, fullgraph=True, dynamic=True)(make(*flags))
    print("equal" if torch.equal(out.values(), expected.values()) else "different")


if __name__ == "__main__":
    main()
