"""The graphs of a model the passes run in: the main graph and every subgraph (the branches of
an ``If``, the body of a ``Loop`` or ``Scan``, at any depth), each as a :class:`Scope`, a model
whose graph is that subgraph (docs/fusions.md#subgraphs)."""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import label


class Scope(ir.Model):
    """A model as a pass sees it inside one subgraph of ``main``: its :attr:`graph` is the
    subgraph; its opset imports and functions are those of ``main`` (a subgraph imports none of
    its own), so a raised opset or an added function is the whole model's. The subgraph reads
    the values of the graphs around it (their initializers and outputs) as they are: the passes
    see outer constants and shapes through the values themselves.

    Attributes:
        main: the whole model.
        owner: the node whose attribute holds the subgraph (an ``If``, ``Loop``, ``Scan``).
        path: where the subgraph is, e.g. ``If 'cond' / then_branch`` (:func:`scopes`).
    """

    def __init__(self, main: ir.Model, graph: ir.Graph, owner: ir.Node, path: str):
        super().__init__(graph, ir_version=main.ir_version)
        self.main = main
        self.owner = owner
        self.path = path

    @property
    def opset_imports(self) -> dict[str, int]:
        return self.main.opset_imports

    @property
    def functions(self) -> dict[ir.OperatorIdentifier, ir.Function]:
        return self.main.functions


def path_of(model: ir.Model) -> str | None:
    """Where ``model``'s graph is: a :class:`Scope`'s path, None for the main graph."""
    return model.path if isinstance(model, Scope) else None


def scopes(model: ir.Model) -> list[Scope]:
    """Every subgraph under ``model``'s graph, depth first in node order, each a :class:`Scope`
    whose path names the node and attribute of each level, ``Loop 'outer' / body / If 'cond' /
    else_branch`` (a list of graphs, as no standard op has, numbers them: ``attr[1]``)."""
    main = model.main if isinstance(model, Scope) else model
    found: list[Scope] = []

    def walk(graph: ir.Graph, path: str | None) -> None:
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    graphs = [(attr.name, attr.value)]
                elif attr.type == ir.AttributeType.GRAPHS:
                    graphs = [(f"{attr.name}[{i}]", g) for i, g in enumerate(attr.value)]
                else:
                    continue
                for name, subgraph in graphs:
                    here = f"{node.op_type} '{label(node)}' / {name}"
                    here = f"{path} / {here}" if path else here
                    found.append(Scope(main, subgraph, node, here))
                    walk(subgraph, here)

    walk(model.graph, path_of(model))
    return found
